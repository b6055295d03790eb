"""Benchmarks: each prints ours against a peer measured in the same run, with ratios."""
