"""Speculative decoding: proposers (n-gram, draft model) behind one interface, the rejection
sampler that verifies their proposals in the target's step, and the acceptance counters."""
