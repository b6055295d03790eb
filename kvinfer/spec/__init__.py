"""Speculative decoding: proposers (n-gram prompt lookup, draft model) and the verification of their tokens."""
