"""The verifier as a fleet: Ray Serve replicas, LLM-aware load balancing, failover, canary rollout."""
