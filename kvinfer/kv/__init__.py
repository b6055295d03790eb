"""KV cache: block bookkeeping (no torch) and the cache tensors of each backend."""
