"""The laboratory: measure the KV cache's cost (lab kvcache), plan memory (plan), simulate scheduling (simulate)."""
