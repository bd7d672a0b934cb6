"""Client half of SecAgg+: the protocol state machine and the Flower mod around it."""
