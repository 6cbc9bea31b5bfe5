"""CUDA graphs for decode steps (vLLM's approach): a decode-only batch is padded up to the
nearest bucket size, copied into static input buffers, and a graph captured once per bucket
replays the whole forward (every layer's kernels in one launch) instead of launching them from
Python one by one.

Padding repeats the batch's last sequence: a padded row computes that sequence's token again and
writes the same K/V to the same slot, so no KV block is needed for it and nothing else changes.
Everything but the capture itself (bucket choice, padding, the static buffers) is plain torch
and runs, and is tested, on the CPU; only CUDAGraphRunner needs a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from quire.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

# 1, 2, 4, 8, then every multiple of this (vLLM captures 1, 2, 4 and multiples of 8)
_BUCKET_STEP = 8


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs
    (which is always one, so every decode batch has a bucket)."""
    sizes = {b for b in (1, 2, 4) if b < max_num_seqs}
    sizes.update(range(_BUCKET_STEP, max_num_seqs, _BUCKET_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def pick_bucket(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds the batch; None if none does (the step runs eagerly)."""
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


class StaticDecodeInputs:
    """The buffers a captured graph reads: allocated once for the largest bucket, refilled in
    place every step (the graph holds their addresses). A bucket's metadata views the first
    `bucket` rows."""

    def __init__(self, max_bucket: int, max_blocks_per_seq: int, block_size: int,
                 max_model_len: int, device: torch.device) -> None:
        self.block_size, self.max_model_len = block_size, max_model_len
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_bucket, **i64)
        self.positions = torch.zeros(max_bucket, **i64)
        self.slot_mapping = torch.zeros(max_bucket, **i64)
        self.seq_lens = torch.ones(max_bucket, **i32)
        self.block_tables = torch.zeros(max_bucket, max_blocks_per_seq, **i32)
        self.query_start_loc = torch.arange(max_bucket + 1, **i32)  # one token per sequence

    def load(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
             seq_lens: np.ndarray, block_tables: np.ndarray, bucket: int) -> None:
        """Copy a decode batch of n <= bucket sequences in, the last one repeated up to bucket."""
        n = len(input_ids)
        if not 0 < n <= bucket <= len(self.input_ids):
            raise ValueError(f"a decode batch of {n} does not fit bucket {bucket} "
                             f"(buffers hold {len(self.input_ids)})")
        if block_tables.shape[1] > self.block_tables.shape[1]:
            raise ValueError(f"block tables of {block_tables.shape[1]} blocks exceed the "
                             f"{self.block_tables.shape[1]} the buffers hold")
        pad = np.full(bucket - n, n - 1)
        rows = np.concatenate([np.arange(n), pad]) if len(pad) else slice(None)
        for buf, src in ((self.input_ids, input_ids), (self.positions, positions),
                         (self.slot_mapping, slot_mapping), (self.seq_lens, seq_lens)):
            buf[:bucket].copy_(torch.from_numpy(np.ascontiguousarray(src[rows])).to(buf.dtype),
                               non_blocking=True)
        width = block_tables.shape[1]
        self.block_tables[:bucket, :width].copy_(
            torch.from_numpy(np.ascontiguousarray(block_tables[rows])), non_blocking=True)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The metadata a graph is captured with: host-side values that plan kernels (the
        longest context) say the worst case, so the plan holds for every later step."""
        return AttentionMetadata(
            num_decodes=bucket, query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket], max_query_len=1,
            max_seq_len=self.max_model_len, block_size=self.block_size,
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=[self.max_model_len] * bucket)


class CUDAGraphRunner:
    """Captures the model's decode forward per bucket on first use, then replays it."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.buckets = decode_buckets(max_num_seqs)
        self.inputs = StaticDecodeInputs(self.buckets[-1], -(-max_model_len // block_size),
                                         block_size, max_model_len, device)
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, output hidden, metadata)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.inputs.input_ids[:bucket], self.inputs.positions[:bucket], meta,
                          self.kv_caches)

    def _capture(self, bucket: int) -> tuple:
        meta = self.inputs.metadata(bucket)
        self.model.prepare(meta)  # the plan's tensors live as long as the graph
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy initialisation stays out of the graph
            self._forward(bucket, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(bucket, meta)
        return graph, hidden, meta

    def _try_capture(self, bucket: int) -> bool:
        try:
            self.graphs[bucket] = self._capture(bucket)
            return True
        except RuntimeError as e:  # something in the forward cannot be captured
            logger.warning("CUDA graph capture failed, decode runs eagerly from now on "
                           "(--enforce-eager skips the attempt): %s", e)
            self.buckets = []
            return False

    def capture_all(self) -> None:
        """Capture every bucket at start-up, largest first (its memory pool then serves the
        smaller ones), as vLLM does. Captured lazily instead, each bucket costs the step that
        first needs it a capture, and a draining batch needs them one after another: on an
        H100 that made graphs slower than eager over a 256-request run. The static inputs
        hold zeros here: the padded rows write junk K/V into slot 0, a free block's slot that
        is written again before anything reads it."""
        start = time.perf_counter()
        for bucket in sorted(self.buckets, reverse=True):
            if bucket not in self.graphs and not self._try_capture(bucket):
                return
        logger.info("captured CUDA graphs for %d decode batch sizes (1 to %d) in %.1f s",
                    len(self.graphs), max(self.graphs, default=0), time.perf_counter() - start)

    def run(self, batch) -> torch.Tensor | None:
        """The hidden states of a decode-only HostBatch, or None if it has no bucket."""
        n = len(batch.input_ids)
        bucket = pick_bucket(n, self.buckets)
        if bucket is None:
            return None
        rope = getattr(batch, "rope_positions", None)  # M-RoPE: [T] shifted past the prompts
        positions = batch.positions if rope is None else rope
        self.inputs.load(batch.input_ids, positions, batch.slot_mapping, batch.seq_lens,
                         batch.block_tables, bucket)
        if bucket not in self.graphs and not self._try_capture(bucket):
            return None
        graph, hidden, _ = self.graphs[bucket]
        graph.replay()
        return hidden[:n]
