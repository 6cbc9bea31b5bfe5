"""Tensor parallelism: the process group, the worker processes, the step broadcast.

The scheduler, the KV-cache manager and the sampler stay in the engine process, which is
also rank 0 of the group; ranks 1..N-1 are spawned worker processes that hold their shards
of the model and of the KV cache and run every step with it.
"""
