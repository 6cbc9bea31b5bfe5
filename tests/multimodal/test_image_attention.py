"""Bidirectional image runs (Gemma 3) piece by piece: the runs, where a chunk may end and the
key limits (multimodal/image_attention.py); the scheduler's rule that a prefill chunk never
ends inside a run; the engine's refusal of a run longer than a step; the torch backend's
masks from key limits against a dense reference (the Triton kernel's check is in
tests/runtime/triton_interpreter_suite.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quire.attention.base import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend, write_kv
from quire.engine.block_pool import BlockPool
from quire.engine.engine import LLMEngine
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request
from quire.engine.scheduler import Scheduler
from quire.multimodal.image_attention import fit_chunk, image_runs, key_limits, longest_run
from quire.multimodal.inputs import ImageSpan, ProcessedPrompt
from quire.sampling_params import SamplingParams
from quire.validation import QuireValidationError

from attention_reference import paged_reference


def span(offset: int, length: int, tag: str = "a") -> ImageSpan:
    return ImageSpan(tag * 64, offset, length)


# --------------------------------------------------------------------------- the positions

def test_adjacent_runs_join_as_transformers_blocks_do():
    """transformers' blocks are maximal runs of image tokens: two images with nothing
    between them are one block."""
    images = [span(2, 4), span(6, 4, "b"), span(12, 3, "c")]
    assert image_runs(images) == [(2, 10), (12, 15)]
    assert longest_run(images) == 8 and longest_run([]) == 0


@pytest.mark.parametrize("start,n,fits", [
    (0, 2, 2),     # ends before the run
    (0, 5, 2),     # would end inside [2, 10): ends at its start instead
    (0, 10, 10),   # ends at the run's end
    (0, 13, 12),   # would end inside [12, 15)
    (4, 4, 0),     # starts inside the run (a prefix hit) and can't finish it: nothing
    (4, 6, 6),     # starts inside and finishes it
    (10, 1, 1),
])
def test_a_chunk_never_ends_inside_a_run(start, n, fits):
    assert fit_chunk([span(2, 4), span(6, 4, "b"), span(12, 3, "c")], start, n) == fits


def test_key_limits_look_ahead_to_the_end_of_the_run():
    images = [span(2, 4), span(9, 3, "b")]
    assert key_limits(images, 0, 14).tolist() == [0, 1, 5, 5, 5, 5, 6, 7, 8, 11, 11, 11, 12,
                                                  13]
    # a chunk that starts inside a run (after a prefix hit) looks ahead just the same
    assert key_limits(images, 3, 4).tolist() == [5, 5, 5, 6]
    # none looks ahead: text only, or only a run's last token
    assert key_limits(images, 12, 2) is None and key_limits(images, 5, 2) is None
    with pytest.raises(RuntimeError, match="ends inside the image run"):
        key_limits(images, 0, 4)


# --------------------------------------------------------------------------- the scheduler

def make_scheduler(budget: int, whole: bool = True, num_blocks: int = 64,
                   caching: bool = False, block_size: int = 4) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size)
    return Scheduler(kv, 8, budget, whole_image_runs=whole)


def make_seq(rid: str, prompt: list[int], images=(), max_tokens: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                   frozenset(), max_tokens, images=tuple(images))


def step(s: Scheduler) -> list[tuple[str, int, int]]:
    """One step: (sequence, start, tokens) per scheduled sequence, then a token for those
    that reached their end."""
    out = s.schedule()
    chunks, sampled = [], {}
    for rid, n in zip(out.seq_ids, out.num_new_tokens):
        seq = s.sequence(rid)
        chunks.append((rid, seq.num_computed_tokens, n))
        if seq.num_computed_tokens + n == seq.num_tokens:
            sampled[rid] = 7
    s.update(out, sampled, {})
    return chunks


def run(s: Scheduler) -> list[list[tuple[str, int, int]]]:
    steps = []
    while s.has_unfinished():
        steps.append(step(s))
        assert len(steps) < 100
    assert s.kv_manager.num_used_blocks == 0
    return steps


def test_the_chunk_ends_before_the_run_then_holds_all_of_it():
    prompt = list(range(100, 130))
    with_rule = make_scheduler(18)
    with_rule.add_request(make_seq("x", prompt, [span(5, 16)]))
    assert run(with_rule)[:3] == [[("x", 0, 5)], [("x", 5, 18)], [("x", 23, 7)]]
    without = make_scheduler(18, whole=False)  # LLaVA: chunks cut through runs
    without.add_request(make_seq("x", prompt, [span(5, 16)]))
    assert run(without)[:2] == [[("x", 0, 18)], [("x", 18, 12)]]


def test_a_run_waits_for_a_step_with_room_and_holds_back_later_arrivals():
    """FCFS: b's first chunk would end inside its run with what a left of the budget, so b
    waits, and c, behind it, does not jump the queue; the next step b gets its run whole."""
    s = make_scheduler(20)
    s.add_request(make_seq("a", list(range(100, 112))))
    s.add_request(make_seq("b", list(range(200, 220)), [span(0, 16)]))
    s.add_request(make_seq("c", list(range(300, 303))))
    assert step(s) == [("a", 0, 12)]
    assert step(s) == [("a", 12, 1), ("b", 0, 19)]
    steps = run(s)
    assert all(not (0 < start + n < 16) for chunks in steps for rid, start, n in chunks
               if rid == "b")


def test_a_prefix_hit_inside_a_run_starts_the_chunk_there():
    """x's blocks are cached; y shares its first two blocks (8 tokens), which end inside the
    run [2, 10): y's first chunk starts at 8 and takes the run's rest with it."""
    s = make_scheduler(20, caching=True)
    x = list(range(100, 112))
    s.add_request(make_seq("x", x, [span(2, 8)]))
    run(s)
    s.add_request(make_seq("y", x[:10] + [900, 901, 902], [span(2, 8)]))
    assert step(s) == [("y", 8, 5)]


def test_the_engine_refuses_a_run_longer_than_a_step():
    """Two images side by side are one run of 32 tokens: more than a 20-token step."""
    engine = SimpleNamespace(args=SimpleNamespace(max_num_batched_tokens=20))
    mm = ProcessedPrompt(list(range(40)), [span(4, 16), span(20, 16, "b")])
    with pytest.raises(QuireValidationError, match="takes 32 tokens.*max_num_batched_tokens "
                                                   "is 20") as err:
        LLMEngine._check_image_runs(engine, mm)
    assert err.value.field == "multi_modal_data"
    mm = ProcessedPrompt(list(range(40)), [span(4, 16), span(21, 16, "b")])
    LLMEngine._check_image_runs(engine, mm)  # 16 and 16: each fits


# ------------------------------------------------------------------ the torch backend's masks

def paged_step(seqs, runs, h=4, hkv=2, d=16, bs=4, seed=0):
    """seqs: (context, query tokens) each, decodes first; runs: per sequence its image
    spans. Random K/V for the cached prefixes in shuffled blocks, random q/k/v for the new
    tokens, and the step's metadata with key limits."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-ctx // bs) for ctx, _ in seqs]
    num_blocks = sum(need) + 2
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)])
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=gen) for _ in range(2)]

    def slots(i, lo, hi):
        pos = torch.arange(lo, hi)
        return tables[i, pos // bs].long() * bs + pos % bs

    for i, (ctx, ql) in enumerate(seqs):
        if ctx > ql:
            write_kv(torch.randn(ctx - ql, hkv, d, generator=gen),
                     torch.randn(ctx - ql, hkv, d, generator=gen), *caches,
                     slots(i, 0, ctx - ql), 1.0, 1.0)
    total = sum(ql for _, ql in seqs)
    q = torch.randn(total, h, d, generator=gen)
    k, v = torch.randn(total, hkv, d, generator=gen), torch.randn(total, hkv, d, generator=gen)
    qsl = np.cumsum([0] + [ql for _, ql in seqs]).tolist()
    own = [key_limits(r, ctx - ql, ql) for (ctx, ql), r in zip(seqs, runs)]
    limits = np.concatenate([np.arange(ctx - ql, ctx) if lim is None else lim
                             for (ctx, ql), lim in zip(seqs, own)])
    meta = AttentionMetadata(
        num_decodes=sum(ql == 1 for _, ql in seqs),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat([slots(i, ctx - ql, ctx) for i, (ctx, ql) in enumerate(seqs)]),
        max_query_len=max(ql for _, ql in seqs), max_seq_len=max(c for c, _ in seqs),
        block_size=bs, query_start_loc_cpu=qsl, seq_lens_cpu=[c for c, _ in seqs],
        key_limits=torch.from_numpy(limits.astype(np.int32)))
    return q, k, v, caches, meta


# a decode; a fresh prompt with a run; a chunk over a cached prefix that starts inside a run
# (a prefix hit) and another with none ahead (the native kernel's); a fresh one without
STEP = [(9, 1), (24, 24), (30, 12), (21, 6), (10, 10)]
RUNS = [[], [span(4, 10)], [span(15, 11)], [span(2, 5)], []]


@pytest.mark.parametrize("window", [None, 4])
def test_torch_backend_masks_match_a_dense_reference(window):
    q, k, v, caches, meta = paged_step(STEP, RUNS)
    scale = 16 ** -0.5
    attn = TorchAttentionBackend(4, 2, 16, scale, window)
    attn.prepare(meta)
    assert sorted(meta.backend_state[attn, "ahead"]) == [1, 2]
    out = attn.forward(q, k, v, *caches, meta)
    want = paged_reference(q, *caches, meta, scale, window=window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    causal = paged_reference(q, *caches, AttentionMetadata(**{**meta.__dict__,
                                                               "key_limits": None}),
                             scale, window=window)
    moved = (want - causal).abs().amax(dim=(1, 2))
    ahead = meta.key_limits > torch.cat([torch.arange(c - n, c) for c, n in STEP])
    assert (moved[ahead] > 1e-3).all() and (moved[~ahead] == 0).all()
