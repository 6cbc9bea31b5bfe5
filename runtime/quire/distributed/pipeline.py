"""Pipeline parallelism's two pieces: a stage's links to its neighbours (what it receives,
what it sends on), and the split of a step's batch into micro-batches.

A step's batch goes through the stages as micro-batches, in order (GPipe within a step):
stage 0 computes micro-batch 1 while stage 1 computes micro-batch 0, and so on, so P stages
with M micro-batches take about (M + P - 1) stage-times instead of M x P. Each stage runs the
micro-batches in order, so a later piece of a prompt finds the K/V its earlier piece wrote in
that stage's layers: a prompt chunk may be cut between micro-batches like a chunked prefill.

Between stages: the hidden states and the residual (x alone for families whose layers keep
their own residual stream), in the model dtype, from each tensor rank to the same tensor
rank of the next stage (after the row-parallel all-reduce every tensor rank holds all of
it). The last stage's tensor rank 0 sends the logits rows (float32: the sampler's widening,
exact) back to rank 0, which samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quire import parallel_state as ps
from quire.step_batch import SequenceChunk


@dataclass
class PipelineLinks:
    rank: int
    tp: int
    stage: int
    num_stages: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, rank: int, size: int, tp: int, cfg, dtype, device) -> PipelineLinks | None:
        """None without pipeline stages."""
        if size == tp:
            return None
        return cls(rank, tp, rank // tp, size // tp, cfg.hidden_size, cfg.vocab_size, dtype,
                   device)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def sends_logits(self) -> bool:
        """The last stage's tensor rank 0 (the one the logits are gathered on)."""
        return self.is_last and self.rank % self.tp == 0

    @property
    def logits_source(self) -> int:
        return (self.num_stages - 1) * self.tp

    # --- hidden states ---------------------------------------------------------------------
    def send_hidden(self, x: torch.Tensor, residual: torch.Tensor | None) -> list:
        """To the next stage; returns the pending work (keep it until it is waited on)."""
        payload = x if residual is None else torch.stack((x, residual))
        return [(ps.send(payload, self.rank + self.tp), payload)]

    def recv_hidden(self, num_tokens: int, with_residual: bool):
        shape = (2, num_tokens, self.hidden_size) if with_residual else (num_tokens,
                                                                         self.hidden_size)
        buf = ps.recv(torch.empty(shape, dtype=self.dtype, device=self.device),
                      self.rank - self.tp)
        return (buf[0], buf[1]) if with_residual else (buf, None)

    # --- the rows rank 0 samples ----------------------------------------------------------
    def send_rows(self, rows: torch.Tensor) -> list:
        rows = rows.float().contiguous()
        return [(ps.send(rows, 0), rows)]

    def recv_rows(self, num_rows: int, pooled: bool) -> torch.Tensor:
        width = self.hidden_size if pooled else self.vocab_size
        return ps.recv(torch.empty((num_rows, width), dtype=torch.float32,
                                   device=self.device), self.logits_source)


def wait_all(pending: list) -> None:
    for work, _tensor in pending:
        work.wait()


def split_micro_batches(chunks: list[SequenceChunk], count: int) -> list[list[SequenceChunk]]:
    """The step's chunks (decodes first) in `count` runs of about equal tokens, in order. A
    prompt chunk that crosses a boundary is cut there (its first piece samples nothing); one
    that asks for prompt logprobs or pooling stays whole."""
    total = sum(len(c.token_ids) for c in chunks)
    count = min(count, total)
    if count <= 1:
        return [chunks]
    bounds = [round(total * (i + 1) / count) for i in range(count)]
    out: list[list[SequenceChunk]] = [[] for _ in range(count)]
    cur = pos = 0
    for c in chunks:
        while True:
            while cur < count - 1 and pos >= bounds[cur]:
                cur += 1
            room, n = bounds[cur] - pos, len(c.token_ids)
            if n <= room or not _cuttable(c):
                out[cur].append(c)
                pos += n
                break
            out[cur].append(dataclasses.replace(c, token_ids=c.token_ids[:room],
                                                num_samples=0))
            c = dataclasses.replace(c, token_ids=c.token_ids[room:], start=c.start + room)
            pos += room
    return [mb for mb in out if mb]


def _cuttable(c: SequenceChunk) -> bool:
    return (len(c.token_ids) > 1 and c.prompt_logprobs is None and c.pool_key is None
            and not c.num_verified)
