"""The one error a tensor-parallel engine cannot recover from."""


class TensorParallelError(RuntimeError):
    """A worker died or a collective failed: the ranks are out of step, so the engine is
    dead (the server's fatal path takes over: /ready and /health fail, clients get errors)."""
