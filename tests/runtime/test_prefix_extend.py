"""Prefill chunks that extend a cached prefix run batched in one native call (paged_extend):
it agrees with the per-sequence torch path it replaces (with soft-capping and sinks, with
transformers' eager order), and an engine with prefix caching (which takes it) gives the same
greedy tokens as one without (which never does)."""

from __future__ import annotations

import random

import pytest
import torch

from quire import LLM, SamplingParams
from quire.attention import paged_extend
from quire.attention.base import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend
from quire.native import loader

from attention_reference import OPTIONS, check, options
from runtime_helpers import assert_no_blocks_in_use

BS = 16
# native, then each ISA build this CPU can run, named for the CPU feature it needs
# (loader.ISA_BUILDS: "scalar" plain C++, "avx2" without AVX-512, "avx512", ...)
MARCHES = ["native", *loader.isa_builds()]


def _step(dtype, window=None, heads=6, kv_heads=2, head_dim=64, decodes=(40,),
          extends=((100, 37), (16, 1), (33, 16), (250, 64)), fresh=(20,), softcap=None):
    """A mixed step: decodes (context lengths), extends ((cached prefix, new tokens)) and fresh
    prefills (lengths), blocks scattered over the cache; the cache already holds every token
    before this step's, as the engine leaves it. Returns (backend, q, k, v, caches, meta)."""
    gen = torch.Generator().manual_seed(0)
    seqs = [(n - 1, 1) for n in decodes] + list(extends) + [(0, n) for n in fresh]
    need = [-(-(c + n) // BS) for c, n in seqs]
    perm = torch.randperm(sum(need) + 3, generator=gen)
    k_cache = torch.randn(len(perm), BS, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(len(perm), BS, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    starts, slots, used = [0], [], 0
    for i, ((cached, new), nb) in enumerate(zip(seqs, need)):
        tables[i, :nb] = perm[used: used + nb]
        used += nb
        pos = torch.arange(cached, cached + new)
        slots.append(tables[i, pos // BS].long() * BS + pos % BS)
        starts.append(starts[-1] + new)
    total = starts[-1]
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        num_decodes=len(decodes), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat(slots), max_query_len=max(n for _, n in seqs),
        max_seq_len=max(lens), block_size=BS, query_start_loc_cpu=starts, seq_lens_cpu=lens)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5, window, softcap)
    return backend, q, k, v, k_cache, v_cache, meta


def _forward(args, native: bool, monkeypatch):
    backend, q, k, v, k_cache, v_cache, meta = args
    meta.backend_state.clear()
    with monkeypatch.context() as m:
        if not native:
            m.setattr(paged_extend, "supported", lambda q, k_cache: False)
        backend.prepare(meta)
        return backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 40])
def test_batched_extend_matches_the_per_sequence_torch_path(dtype, tol, window, march,
                                                            monkeypatch):
    # every build this CPU runs: the AVX2 one walks rows in tiles, the others row by row
    args = _step(dtype, window, extends=((100, 37), (16, 1), (33, 16), (250, 64), (7, 9)))
    assert paged_extend.supported(args[1], args[4])  # the native kernel is what runs
    library = paged_extend._library(march)
    assert library is not None, f"paged_decode.cpp did not build for {march}"
    monkeypatch.setattr(paged_extend, "_library", lambda: library)
    got = _forward(args, True, monkeypatch)
    want = _forward(args, False, monkeypatch)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_batched_extend_with_soft_capping_and_sinks(dtype, tol, option, march, monkeypatch):
    """SDPA can do neither, so every prefill chunk (fresh, and over a cached prefix) runs
    natively, whichever way the build walks rows; against transformers' eager order."""
    opts = options(option, 6)
    backend, q, k, v, k_cache, v_cache, meta = _step(
        dtype, opts["window"], extends=((100, 37), (16, 1), (33, 16), (7, 9)),
        softcap=opts["softcap"])
    library = paged_extend._library(march)
    monkeypatch.setattr(paged_extend, "_library", lambda: library)
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, sinks=opts["sinks"])
    (rows, _, _), plan = meta.backend_state[backend, "prefill_split", True]
    assert len(rows) == 37 + 1 + 16 + 9 + 20 and not plan
    check(out, q, k_cache, v_cache, meta, backend.scale, tol, **opts)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 1, 128), (6, 3, 48)])
def test_batched_extend_over_head_layouts(heads, kv_heads, head_dim, monkeypatch):
    # no GQA, one KV head for many query heads, and a head size off the fixed-shape path
    args = _step(torch.float32, None, heads, kv_heads, head_dim)
    torch.testing.assert_close(_forward(args, True, monkeypatch),
                               _forward(args, False, monkeypatch), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tiled,bf16_dot,vendor", [
    (False, False, "GenuineIntel"), (True, False, "GenuineIntel"), (True, True, "GenuineIntel"),
    (True, True, "AuthenticAMD")])
def test_long_chunks_take_sdpa_unless_the_kernel_tiles(tiled, bf16_dot, vendor, dtype, tol,
                                                       monkeypatch):
    """Where the kernel walks rows alone, a long chunk over a cached prefix (a long prompt's
    later chunk) goes to SDPA and the short ones in the same step to the native kernel; where
    it tiles, every chunk stays native, except bfloat16 chunks of BF16_DOT_SDPA_MIN_ROWS or
    more (fresh or not) on an Intel CPU with a bfloat16 dot product, whose SDPA is faster (on
    AMD's it is slower: they stay native). Either way the step's output is the reference's."""
    from quire import platform
    from quire.attention.torch_backend import EXTEND_SDPA_MIN_ROWS
    from quire.native import prefill_attention
    long_rows = EXTEND_SDPA_MIN_ROWS + 44
    monkeypatch.setattr(paged_extend, "tiled", lambda q, k_cache: tiled)
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: bf16_dot)
    monkeypatch.setattr(platform, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(prefill_attention, "serves", lambda q, num_kv_heads: False)
    args = _step(dtype, extends=((100, 37), (120, long_rows), (33, 16)))
    backend, meta = args[0], args[-1]
    got = _forward(args, True, monkeypatch)
    (rows, _, _), plan = meta.backend_state[backend, "prefill_split", False]
    planned = [len(range(q0, q1)) for q0, q1, *_ in plan]  # fresh chunks first
    if tiled and bf16_dot and vendor == "GenuineIntel" and dtype == torch.bfloat16:
        # below 24 rows natively
        assert len(rows) == 16 + 20 and planned == [37, long_rows]
    elif tiled:  # the fresh prompt's 20 rows too
        assert len(rows) == 37 + long_rows + 16 + 20 and not plan
    else:
        assert len(rows) == 37 + 16  # the short chunks' rows, natively
        assert planned == [20, long_rows]  # the fresh prompt, then the long chunk, by SDPA
    want = _forward(args, False, monkeypatch)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_vector_builds_tile_the_fixed_shapes_only():
    # (heads, kv heads, head_dim, block size): SmolLM2's layout and head_dim 128 tile on every
    # AVX2 or AVX-512 build; a head size off the fixed shapes, another block size, or the
    # plain C++ build walk rows alone
    vector_builds = [m for m in MARCHES if m not in ("native", "scalar")]
    assert vector_builds or "avx2" not in open("/proc/cpuinfo").read()
    for march in vector_builds:
        assert paged_extend._tiled(9, 3, 64, 16, march), march
        assert paged_extend._tiled(32, 8, 128, 16, march), march
        assert not paged_extend._tiled(6, 3, 48, 16, march), march
        assert not paged_extend._tiled(9, 3, 64, 32, march), march
    assert not paged_extend._tiled(9, 3, 64, 16, "scalar")


def test_the_amx_prefill_kernel_keeps_long_chunks_where_the_paged_kernel_tiles(monkeypatch):
    """A bfloat16 step on a CPU whose AMX prefill kernel serves the layout: chunks of
    AMX_EXTEND_MIN_ROWS new rows or more over a cached prefix, and fresh prompts, go to it
    (per-sequence plans), the shorter chunks to the tiled paged kernel, even where that tiles
    the layout (it would otherwise take every chunk)."""
    from quire.attention import torch_backend
    from quire.native import prefill_attention
    short = torch_backend.AMX_EXTEND_MIN_ROWS - 1
    monkeypatch.setattr(paged_extend, "supported", lambda q, k_cache: True)
    monkeypatch.setattr(paged_extend, "tiled", lambda q, k_cache: True)
    monkeypatch.setattr(prefill_attention, "serves", lambda q, num_kv_heads: True)
    ran = []
    monkeypatch.setattr(paged_extend, "paged_extend", lambda *a, **k: ran.append(a[5]))
    backend, q, k, v, k_cache, v_cache, meta = _step(
        torch.bfloat16, extends=((100, short), (16, 1), (33, short + 1), (250, 64)))
    backend.prepare(meta)
    plan = backend._prefill(q, k_cache, v_cache, torch.empty_like(q), meta, None, False)
    (rows, _, _), _ = meta.backend_state[backend, "prefill_split", False]
    assert len(rows) == short + 1 and len(ran) == 1  # the two short chunks, natively
    # the fresh prompt, then the long chunks over a cached prefix, for the AMX kernel
    assert [q1 - q0 for q0, q1, *_ in plan] == [20, short + 1, 64]


def test_extend_rows_index_each_query_token():
    args = _step(torch.float32)
    meta = args[-1]
    rows, row_seq, row_lens = paged_extend.extend_rows(meta, [1, 2])
    # sequence 1: 100 cached + 37 new at rows 1..37; sequence 2: 16 cached + 1 new at row 38
    assert rows.tolist() == list(range(1, 39))
    assert row_seq.tolist() == [1] * 37 + [2]
    assert row_lens.tolist() == list(range(101, 138)) + [17]


def _llm(path, **kw):
    return LLM(path, dtype="float32", max_num_batched_tokens=96, **kw)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_engine_with_cached_prefixes_matches_the_uncached_engine(tiny_models, family):
    # shared prefixes of several lengths, chunked prefill (96-token budget): later requests
    # extend cached prefixes, several in one step; mistral's window is shorter than them
    rng = random.Random(3)
    system = [rng.randrange(3, 49152) for _ in range(150)]
    prompts = [system[: rng.choice([17, 64, 100, 150])]
               + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 50))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12)
    on = _llm(tiny_models[family])
    off = _llm(tiny_models[family], enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    on.generate(prompts[:2], params, use_tqdm=False)  # warm the cache with two of them
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert on.engine.kv_manager.prefix_hits > 0
    assert on.engine.snapshot().blocks_used == 0
    assert_no_blocks_in_use(off)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_rows_keep_their_bits_whatever_their_tiles(dtype, march, monkeypatch):
    """A verification's 9 rows over one sequence are cut into smaller tiles when the call has
    too few work items for the threads (3 KV heads, 2 threads), and into none on one thread
    or beside other sequences' rows: every row gets the same bits each way, and the right
    attention (the per-sequence torch path's)."""
    library = paged_extend._library(march)
    assert library is not None, f"paged_decode.cpp did not build for {march}"
    monkeypatch.setattr(paged_extend, "_library", lambda: library)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    alone = _step(dtype, heads=9, kv_heads=3, decodes=(), extends=((291, 9),), fresh=())
    batch = _step(dtype, heads=9, kv_heads=3, decodes=(), fresh=(),
                  extends=((291, 9), (100, 17), (40, 2), (7, 9), (250, 5)))
    # the same cache, block tables and rows for the 9 rows in both steps
    b_backend, b_q, b_k, b_v, b_kc, b_vc, b_meta = batch
    a_backend, a_q, a_k, a_v, _, _, a_meta = alone
    a_q, a_k, a_v = b_q[:9].clone(), b_k[:9].clone(), b_v[:9].clone()
    a_meta.block_tables = b_meta.block_tables[:1].clone()
    a_meta.slot_mapping = b_meta.slot_mapping[:9].clone()
    alone = (a_backend, a_q, a_k, a_v, b_kc, b_vc, a_meta)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _forward(alone, True, monkeypatch)
        torch.set_num_threads(1)
        one = _forward(alone, True, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    in_batch = _forward(batch, True, monkeypatch)[:9]
    assert torch.equal(two, one) and torch.equal(two, in_batch)
    torch.testing.assert_close(two.float(), _forward(alone, False, monkeypatch).float(),
                               atol=tol, rtol=tol)
    torch.testing.assert_close(_forward(batch, True, monkeypatch).float(),
                               _forward(batch, False, monkeypatch).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_vector_build_tiles_with_the_avx2_builds_bits(dtype, monkeypatch):
    """The AVX-512 builds' tiles take 12 query vectors a pass on 16 lanes, the AVX2 build's 6
    on 8 lanes: each lane sums the same products in the same order, so every extend row (tiles of 2
    to 16 rows, and a tile of one) has the same bits on every build."""
    from quire.native import prefill_attention
    builds = [m for m in MARCHES if m not in ("native", "scalar")]
    if "avx2" not in builds:
        assert "avx2" not in open("/proc/cpuinfo").read()
        return
    monkeypatch.setattr(paged_extend, "sdpa_min_rows", lambda q: None)
    monkeypatch.setattr(prefill_attention, "serves", lambda q, num_kv_heads: False)
    args = _step(dtype, heads=9, kv_heads=3, decodes=(),
                 extends=((100, 37), (16, 1), (33, 16), (250, 64), (7, 9), (40, 2)))
    libraries = {march: paged_extend._library(march) for march in builds}
    outs = {}
    for march, library in libraries.items():
        monkeypatch.setattr(paged_extend, "_library", lambda library=library: library)
        outs[march] = _forward(args, True, monkeypatch)
    for march, out in outs.items():
        assert torch.equal(out, outs["avx2"]), march
