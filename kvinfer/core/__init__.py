"""The token-level core: requests, the scheduler that plans each step over the KV manager, and the sampler."""
