"""Server half of SecAgg+: the protocol engine, its driver and the round-loop aggregator."""
