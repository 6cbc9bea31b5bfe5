"""A live `quire serve` of a tiny random Llama for the scoring tests: float32, chunked prefill
(16 tokens a step) and prefix caching on; started by the fixture that asks, stopped after."""

from __future__ import annotations

import contextlib

from server_harness import ServerProcess, runtime_helpers, tiny_model

CHUNK_TOKENS = 16


@contextlib.contextmanager
def running_server(name: str, args: list[str]):
    """A ServerProcess, ready; stopped (by its PID) when the block ends, failed or not."""
    srv = ServerProcess(name, args)
    srv.start()
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        srv.stop()


def scoring_server_args() -> list[str]:
    return [tiny_model(), "--dtype", "float32", "--kv-cache-memory", "16M",
            "--num-threads", "1", "--max-num-batched-tokens", str(CHUNK_TOKENS),
            "--max-num-seqs", "8"]


def hf_logprobs(path: str):
    """prompt ids -> transformers' float32 log-softmax at each position [len, vocab]."""
    import torch
    model = runtime_helpers().hf_model(path)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return logprobs
