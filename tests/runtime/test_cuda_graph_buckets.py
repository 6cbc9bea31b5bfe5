"""CUDA-graph decode, the parts that run on the CPU: bucket sizes, padding a batch into the
static buffers (reused, never reallocated), and a whole engine whose decode steps go through
the graph runner's padded buffers (the capture replaced by an eager forward) giving the same
tokens as the plain engine. The capture itself needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quire import LLM, SamplingParams
from quire.worker import cuda_graphs
from quire.worker.cuda_graphs import (
    CUDAGraphRunner,
    StaticDecodeInputs,
    decode_buckets,
    pick_bucket,
)

from runtime_helpers import assert_no_blocks_in_use, random_prompts


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    buckets = decode_buckets(256)
    for n in range(1, 257):
        b = pick_bucket(n, buckets)
        assert b is not None and b >= n and b - n < 8  # padding wastes under one step
        assert all(x < n for x in buckets if x < b)     # and it is the smallest that fits
    assert pick_bucket(257, buckets) is None


def _decode_batch(n, width, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(3, 1000, n), rng.integers(0, 500, n), rng.integers(0, 4000, n),
            rng.integers(1, 500, n).astype(np.int64), rng.integers(0, 250, (n, width)).astype(np.int32))


def test_static_inputs_pad_with_the_last_sequence_and_reuse_their_buffers():
    inputs = StaticDecodeInputs(max_bucket=16, max_blocks_per_seq=8, block_size=16,
                                max_model_len=128, device=torch.device("cpu"))
    pointers = [t.data_ptr() for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                       inputs.seq_lens, inputs.block_tables)]
    ids, pos, slots, lens, tables = _decode_batch(5, 3)
    inputs.load(ids, pos, slots, lens, tables, bucket=8)
    assert inputs.input_ids[:8].tolist() == [*ids.tolist(), *[ids[-1]] * 3]
    assert inputs.positions[:8].tolist() == [*pos.tolist(), *[pos[-1]] * 3]
    assert inputs.slot_mapping[:8].tolist() == [*slots.tolist(), *[slots[-1]] * 3]
    assert inputs.seq_lens[:8].tolist() == [*lens.tolist(), *[lens[-1]] * 3]
    assert inputs.block_tables[:8, :3].tolist() == [*tables.tolist(), *[tables[-1].tolist()] * 3]
    # a second, smaller batch into the same buffers (a graph holds their addresses)
    ids2, pos2, slots2, lens2, tables2 = _decode_batch(2, 8, seed=1)
    inputs.load(ids2, pos2, slots2, lens2, tables2, bucket=2)
    assert inputs.input_ids[:2].tolist() == ids2.tolist()
    assert inputs.block_tables[:2].tolist() == tables2.tolist()
    assert pointers == [t.data_ptr() for t in (inputs.input_ids, inputs.positions,
                                               inputs.slot_mapping, inputs.seq_lens,
                                               inputs.block_tables)]
    meta = inputs.metadata(8)
    assert meta.num_decodes == 8 and meta.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()
    assert meta.query_start_loc.tolist() == list(range(9))
    assert meta.seq_lens_cpu == [128] * 8  # plans for the longest context


def test_static_inputs_reject_what_does_not_fit():
    inputs = StaticDecodeInputs(4, 2, 16, 32, torch.device("cpu"))
    with pytest.raises(ValueError, match="bucket"):
        inputs.load(*_decode_batch(5, 2), bucket=4)
    with pytest.raises(ValueError, match="block tables"):
        inputs.load(*_decode_batch(2, 3), bucket=2)


class _EagerGraphRunner(CUDAGraphRunner):
    """The graph runner with its capture replaced by an eager forward over the same static
    buffers and metadata: everything but the CUDA graph itself."""

    captured: list

    def _capture(self, bucket):
        meta = self.inputs.metadata(bucket)
        self.model.prepare(meta)
        hidden = self._forward(bucket, meta)
        self.captured.append(bucket)
        forward = self._forward

        class Replay:
            def replay(self):
                hidden.copy_(forward(bucket, meta))
        return Replay(), hidden, meta


def test_decode_through_padded_static_buffers_gives_the_same_tokens(tiny_models):
    """One engine three ways: plain; through the graph runner capturing each bucket when a
    step first needs it; through a runner that captured every bucket up front (largest
    first) and captures nothing after. The same tokens each time, and no block left."""
    prompts = random_prompts(n=11)
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(tiny_models["llama"], dtype="float32", max_num_seqs=24, kv_cache_memory=16 << 20)
    runner, engine = llm.engine.executor.runner, llm.engine
    assert runner.cuda_graphs is None  # the CPU never captures
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def graph_runner():
        graphs = _EagerGraphRunner(engine.executor.model, runner.kv_cache.layers, 24,
                                   engine.max_model_len, engine.block_size, torch.device("cpu"))
        graphs.captured = []
        runner.cuda_graphs = graphs
        return graphs

    lazy = graph_runner()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert lazy.captured and all(b in decode_buckets(24) for b in lazy.captured)
    assert len(set(lazy.captured)) == len(lazy.captured)  # each bucket captured once
    assert_no_blocks_in_use(llm)

    upfront = graph_runner()
    upfront.capture_all()
    assert upfront.captured == sorted(decode_buckets(24), reverse=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want  # the junk the capture wrote into slot 0 was never read
    assert upfront.captured == sorted(decode_buckets(24), reverse=True)  # none captured later
    assert_no_blocks_in_use(llm)


def test_a_failed_capture_falls_back_to_eager_for_good(caplog):
    class Failing(CUDAGraphRunner):
        attempts = 0

        def _capture(self, bucket):
            Failing.attempts += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    runner = Failing(None, [], 8, 64, 16, torch.device("cpu"))
    ids, pos, slots, lens, tables = _decode_batch(3, 2)

    class Batch:
        input_ids, positions, slot_mapping, seq_lens, block_tables = ids, pos, slots, lens, tables
    assert runner.run(Batch) is None and runner.run(Batch) is None
    assert Failing.attempts == 1 and "runs eagerly" in caplog.text


def test_enforce_eager_is_an_engine_flag():
    from quire.config import EngineArgs
    assert EngineArgs().enforce_eager is False
    assert EngineArgs(enforce_eager=True).enforce_eager is True
    assert cuda_graphs.pick_bucket(1, [1]) == 1
