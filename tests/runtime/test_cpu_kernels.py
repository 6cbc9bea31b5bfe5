"""The native CPU decode kernel against scaled_dot_product_attention (with soft-capping and
sinks, against transformers' eager order), and the engine's pure-torch fallback where the
kernel can't be built."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from quire import LLM, SamplingParams
from quire.native import loader, paged_attention

from attention_reference import OPTIONS, check, options
from runtime_helpers import assert_no_blocks_in_use, random_prompts


def _reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window):
    num_kv_heads, head_dim = k_cache.shape[2:]
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(length)
        slots = block_tables[i][pos // bs].long() * bs + pos % bs
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1).float()
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1).float()
        mask = pos >= length - window if window else None
        o = F.scaled_dot_product_attention(q[i][:, None].float(), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[i] = o[:, 0].to(q.dtype)
    return out


_FLAGS = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
# every build this CPU can run: native, then each ISA build it can execute, named for the CPU
# feature it needs (loader.ISA_BUILDS: "scalar" the plain C++ path, "avx2" the path of a
# CPU without AVX-512, "avx512", "avx512_bf16", "amx")
MARCHES = ["native", *loader.isa_builds()]
# the builds whose extend runs the fixed shapes in tiles: every one with AVX2 (8 lanes) or
# AVX-512 (16)
TILED = [m for m in MARCHES if m != "scalar" and (m != "native" or " avx2" in _FLAGS)]
# the build that also sums decode rows in parts and reads shared prefixes from 4 blocks on in
# the cascade's tiles (the AVX-512 builds from 24): AVX2 without AVX-512
MERGED = [m for m in MARCHES
          if m == "avx2" or (m == "native" and " avx2" in _FLAGS and " avx512f" not in _FLAGS)]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,window", [
    (2, 1, 64, 16, None), (3, 3, 64, 16, None), (1, 8, 128, 8, None), (2, 2, 16, 32, None),
    (2, 3, 64, 16, 20), (1, 2, 48, 16, None), (2, 4, 128, 16, None), (1, 8, 128, 16, 33),
])
def test_native_decode_matches_sdpa(dtype, kv_heads, group, head_dim, block_size, window,
                                    march):
    assert paged_attention.native_decode_supported(torch.zeros(1, dtype=dtype),
                                               torch.zeros(1, dtype=dtype))
    assert paged_attention._library(march) is not None, f"paged_decode.cpp did not build for {march}"
    torch.manual_seed(0)
    num_blocks, max_blocks = 64, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    # lengths at and around block boundaries; block tables shuffled (non-contiguous)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 6 * block_size]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens]).int()
    q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_decode(q, k_cache, v_cache, out, tables, seq_lens, head_dim ** -0.5, window,
                             _march=march)
    want = _reference(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim,window,extras", [
    (3, 3, 64, None, False), (1, 8, 128, None, False), (2, 2, 64, 20, False),
    (1, 5, 64, None, True), (3, 3, 64, 300, True),
])
@pytest.mark.parametrize("lengths", [
    [37, 1, 16, 90, 5, 128, 129, 257, 600, 1100, 2100],
    # no row in parts on the AVX-512 builds: a sequence a grab, the next one fetched meanwhile
    # (one past the fetch's cap, 384 KiB at most: 900 tokens of 1 x 128 bfloat16, 600 of
    # float32)
    [37, 1, 16, 90, 5, 128, 129, 257, 600, 900, 33, 70],
], ids=["long", "short"])
def test_a_sequence_alone_has_the_bits_it_has_in_a_batch(dtype, kv_heads, group, head_dim,
                                                          window, extras, lengths, march):
    """Batch invariance of decode attention: a sequence's (sequence, KV head) items are summed
    the same whatever else the call holds and however the threads take them, so a lone
    sequence gets exactly the bits it gets in a batch of eleven or more, and the batch on one thread
    the bits it gets on all (with a window, soft-capping and sinks too). Rows past 128 tokens
    are summed in parts on the AVX2 build (ending at fixed multiples of 128 of the row's own
    context, merged in order; on the AVX-512 builds rows past 1,024 tokens, in parts of
    1,024), so a long row alone, whose parts spread over the threads, keeps its bits too. (Splitting a lone sequence's query heads across the threads, tried for
    balance, would keep this; it read each KV head twice and was not faster.)"""
    torch.manual_seed(1)
    num_blocks, block_size = 160, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    # at least two rows a thread, so that a batch is taken a sequence a grab on any host
    count = max(len(lengths), 2 * torch.get_num_threads())
    lens = torch.tensor([lengths[i % len(lengths)] for i in range(count)], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:132] for _ in range(len(lens))]).int()
    q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=dtype)
    kw = {"softcap": 30.0, "sinks": torch.randn(kv_heads * group)} if extras else {}

    def run(rows):
        out = torch.full_like(q[rows], float("nan"))
        paged_attention.paged_decode(q[rows], k_cache, v_cache, out, tables[rows], lens[rows],
                                     head_dim ** -0.5, window, _march=march, **kw)
        return out

    batch = run(slice(None))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(slice(None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batch)
    for i in range(len(lens)):
        assert torch.equal(run(slice(i, i + 1))[0], batch[i]), f"sequence {i}"


def test_engine_without_the_native_kernel_gives_the_same_tokens(tiny_models, monkeypatch):
    prompts = random_prompts(6, lengths=[1, 15, 16, 17, 100, 300], seed=9)
    params = SamplingParams(temperature=0, max_tokens=20)
    native = LLM(tiny_models["mistral"], dtype="float32", kv_cache_memory=8 << 20)
    expected = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("QUIRE_CPU_KERNELS", "0")
    paged_attention._library.cache_clear()
    loader.load_library.cache_clear()
    try:
        fallback = LLM(tiny_models["mistral"], dtype="float32", kv_cache_memory=8 << 20)
        assert not paged_attention.native_decode_supported(torch.zeros(1), torch.zeros(1))
        got = [o.outputs[0].token_ids for o in fallback.generate(prompts, params, use_tqdm=False)]
    finally:
        paged_attention._library.cache_clear()
        loader.load_library.cache_clear()
    assert got == expected
    assert_no_blocks_in_use(fallback)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 128), (1, 8, 64)])
def test_decode_rows_sharing_a_cached_prefix_match_sdpa(dtype, kv_heads, group, head_dim,
                                                        march):
    """Rows whose block tables start with the same blocks (prefix caching) read that prefix
    once, in tiles, then their own tails, merged by log-sum-exp (the AVX2 build): the
    same attention as reading each row alone. Groups: six rows sharing 10 blocks, two of which
    diverge after 6 (so the group shares 6), one whose length caps the shared part; four rows
    sharing 8 other blocks, one of them one token past them; three rows too few to share;
    two unrelated rows."""
    from quire.attention import paged_extend
    torch.manual_seed(1)
    bs, num_blocks = 16, 200
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    fresh = iter(range(100, num_blocks))
    tables, lens = [], []

    def row(prefix: list[int], length: int) -> None:
        own = [next(fresh) for _ in range(-(-length // bs) - len(prefix))]
        tables.append((prefix + own)[: -(-length // bs)])
        lens.append(length)

    shared_a = list(range(10))
    for length in (10 * bs + 1, 11 * bs + 5, 13 * bs, 7 * bs - 3):
        row(shared_a, length)
    for length in (12 * bs + 9, 9 * bs):  # diverge after block 6
        row(shared_a[:6] + [next(fresh) for _ in range(4)], length)
    shared_b = list(range(20, 28))
    for length in (8 * bs + 1, 9 * bs + 2, 15 * bs, 8 * bs + 15):
        row(shared_b, length)
    for length in (6 * bs + 3, 7 * bs, 8 * bs + 1):  # only three share these
        row(list(range(40, 46)), length)
    row([], 3 * bs + 2)
    row([], 1)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out, alone = _decode_against_the_reference(k_cache, v_cache, block_tables, seq_lens, march,
                                               tol, kv_heads * group)
    # where the build tiles this layout, the shared prefixes really went through the tiles:
    # rows read alone (one call each, no group) sum in another order
    tiled = paged_extend._tiled(kv_heads * group, kv_heads, head_dim, bs, march)
    assert tiled == (march in TILED and head_dim in (64, 128))
    if march in MERGED:
        assert not torch.equal(out[:14], alone[:14]), "no shared prefix went through a tile"
        torch.testing.assert_close(out[14:], alone[14:], atol=0, rtol=0)  # not shared: as alone


@pytest.mark.parametrize("march", MERGED)
def test_cascade_groups_follow_the_longest_shared_prefix(march):
    """Chat requests all start with one template header (a block here), and behind it groups
    of them share long system prompts. The header alone is too short to share, but the rows
    behind each long prompt still read it once, in tiles: the groups split where the longer
    prefixes part. Rows sharing only the header read alone (bit-identical to a lone call)."""
    torch.manual_seed(2)
    bs, kv_heads, group, head_dim = 16, 3, 3, 64
    k_cache = torch.randn(200, bs, kv_heads, head_dim)
    v_cache = torch.randn(200, bs, kv_heads, head_dim)
    fresh = iter(range(100, 200))
    header = [0]
    prompts = {"a": list(range(1, 9)), "b": list(range(20, 26)), "c": list(range(40, 43))}
    # four behind prompt a, five behind b, one of them cutting b's share from 7 blocks to 6
    # (still worth one group of five: 4 x 6 block reads saved, against 3 x 7 without it),
    # three behind c (too few), two with the header alone
    layout = ["a", "b", "a", "c", "b", "a", "b", "c", "a", "b", "", "c", "b", ""]
    tables, lens = [], []
    for i, name in enumerate(layout):
        prefix = header + prompts[name] if name else header
        if name == "b" and i == 12:
            prefix = header + prompts["b"][:5]
        own = [next(fresh) for _ in range(2)]
        tables.append(prefix + own)
        lens.append(len(tables[-1]) * bs - i % 5)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), kv_heads * group, head_dim)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_decode(q, k_cache, v_cache, out, block_tables, seq_lens, scale, None,
                             _march=march)
    want = _reference(q, k_cache, v_cache, block_tables, seq_lens, scale, None)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    alone = torch.cat([_alone(q, k_cache, v_cache, block_tables, seq_lens, scale, march, i)
                       for i in range(len(lens))])
    for i, name in enumerate(layout):
        if name in ("a", "b"):
            assert not torch.equal(out[i], alone[i]), f"row {i} (prompt {name}) read alone"
        else:
            torch.testing.assert_close(out[i], alone[i], atol=0, rtol=0)


@pytest.mark.parametrize("march", TILED)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rows_sharing_a_long_prefix_read_it_once_on_every_vector_build(march, dtype, tol):
    """A long cached prefix (30 blocks: past the AVX-512 builds' 24-block minimum, the AVX2
    build's 4) shared by six decode rows goes through the cascade's tiles on every vector
    build, in either dtype: the attention of each row read alone (in float32 in other bits);
    rows that share nothing keep a lone call's bits."""
    torch.manual_seed(6)
    bs, kv_heads, group, head_dim = 16, 3, 3, 64
    k_cache = torch.randn(130, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(130, bs, kv_heads, head_dim, dtype=dtype)
    shared = list(range(30))
    tables = [shared + [40 + 3 * i, 41 + 3 * i, 42 + 3 * i] for i in range(6)]
    tables += [list(range(60 + 33 * j, 93 + 33 * j))[:33] for j in range(2)]
    lens = [30 * bs + 1, 31 * bs, 33 * bs - 3, 32 * bs + 5, 30 * bs + 9, 33 * bs, 20 * bs, 33 * bs]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out, alone = _decode_against_the_reference(k_cache, v_cache, block_tables, seq_lens, march,
                                               tol, kv_heads * group)
    if dtype == torch.float32:  # (in bfloat16 the other sums mostly round to the same output)
        for i in range(6):
            assert not torch.equal(out[i], alone[i]), f"row {i} read its prefix alone"
    torch.testing.assert_close(out[6:], alone[6:], atol=0, rtol=0)


def _decode_against_the_reference(k_cache, v_cache, block_tables, seq_lens, march, tol,
                                  num_heads):
    """One decode call over every row (random q), checked against the reference: (its output,
    each row's output from a call of its own)."""
    head_dim = k_cache.shape[-1]
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=k_cache.dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_decode(q, k_cache, v_cache, out, block_tables, seq_lens, scale, None,
                                 _march=march)
    want = _reference(q, k_cache, v_cache, block_tables, seq_lens, scale, None)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    alone = torch.cat([_alone(q, k_cache, v_cache, block_tables, seq_lens, scale, march, i)
                       for i in range(len(seq_lens))])
    return out, alone


def _alone(q, k_cache, v_cache, block_tables, seq_lens, scale, march, i):
    out = torch.empty_like(q[i:i + 1])
    paged_attention.paged_decode(q[i:i + 1], k_cache, v_cache, out, block_tables[i:i + 1],
                             seq_lens[i:i + 1], scale, None, _march=march)
    return out


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(2, 3, 64), (1, 4, 128), (1, 2, 48)])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_native_decode_soft_capping_and_sinks_match_eager_attention(
        dtype, kv_heads, group, head_dim, option, march):
    """Every build (AVX-512, AVX2, plain C++), the fixed shapes and the general loop, against
    transformers' eager order in float32; windows shorter than the longer contexts."""
    from types import SimpleNamespace
    torch.manual_seed(3)
    bs, num_blocks = 16, 40
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    lens = [1, bs - 1, bs, bs + 1, 40, 70]
    tables = torch.stack([torch.randperm(num_blocks)[:5] for _ in lens]).int()
    q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=dtype)
    opts = options(option, kv_heads * group)
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_decode(q, k_cache, v_cache, out, tables, torch.tensor(lens, dtype=torch.int32),
                             head_dim ** -0.5, opts["window"], opts["softcap"], opts["sinks"],
                             _march=march)
    meta = SimpleNamespace(query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=lens,
                           block_tables=tables)
    check(out, q, k_cache, v_cache, meta, head_dim ** -0.5,
          1e-5 if dtype == torch.float32 else 1e-2, **opts)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("option", ["softcap", "sinks"])
def test_decode_rows_sharing_a_prefix_with_soft_capping_and_sinks(option, march):
    """The cascade (AVX2 build, float32): the shared prefix's tiles cap their scores too, and
    the sink joins once, where the prefix and tail parts merge."""
    from types import SimpleNamespace
    torch.manual_seed(4)
    bs, kv_heads, group, head_dim = 16, 3, 3, 64
    k_cache = torch.randn(60, bs, kv_heads, head_dim)
    v_cache = torch.randn(60, bs, kv_heads, head_dim)
    tables = [list(range(6)) + [10 + i, 20 + i] for i in range(5)]  # five share six blocks
    tables += [[30 + j for j in range(8)], [40 + j for j in range(8)]]
    lens = [6 * bs + 1, 7 * bs, 8 * bs - 3, 7 * bs + 5, 6 * bs + 9, 8 * bs, 5 * bs + 2]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), kv_heads * group, head_dim)
    opts = options(option, kv_heads * group)
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_decode(q, k_cache, v_cache, out, block_tables, seq_lens, head_dim ** -0.5,
                             None, opts["softcap"], opts["sinks"], _march=march)
    meta = SimpleNamespace(query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=lens,
                           block_tables=block_tables)
    check(out, q, k_cache, v_cache, meta, head_dim ** -0.5, 1e-5, **opts)
    if march in MERGED:  # the shared rows went through the cascade's tiles
        alone = torch.empty_like(q[:1])
        paged_attention.paged_decode(q[:1], k_cache, v_cache, alone, block_tables[:1],
                                 seq_lens[:1], head_dim ** -0.5, None, opts["softcap"],
                                 opts["sinks"], _march=march)
        assert not torch.equal(out[:1], alone)


# lengths around the parts' edges (paged_decode.cpp's kPartTokens: 128 on the AVX2 build,
# 1,024 from 1,024 on the AVX-512 builds)
_LONG_LENS = [127, 128, 129, 256, 257, 300, 511, 640, 1024, 1025, 2100]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (1, 8, 128), (2, 1, 64)])
@pytest.mark.parametrize("option", [None, *OPTIONS])
def test_long_contexts_summed_in_parts_match_eager_attention(dtype, kv_heads, group, head_dim,
                                                             option, march):
    """Contexts past one part (the AVX2 build sums them in parts of 128 tokens, the AVX-512
    builds those past 1,024 in parts of 1,024, merged by log-sum-exp; the plain C++ build in
    one item) give transformers' eager attention: with windows
    that start inside a part or on its edge, soft-capping, and sinks that join once."""
    from types import SimpleNamespace
    torch.manual_seed(5)
    bs, num_blocks = 16, 140
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    lens = _LONG_LENS
    tables = torch.stack([torch.randperm(num_blocks)[:132] for _ in lens]).int()
    q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=dtype)
    opts = options(option, kv_heads * group) if option else dict(softcap=None, sinks=None,
                                                                 window=None)
    if opts["window"]:
        # float32: from inside the first part or the second to the end; bfloat16 (whose
        # tolerance needs the window to move the output more) a few keys across an edge
        opts["window"] = 200 if dtype == torch.float32 else 12
    if opts["sinks"] is not None:
        opts["sinks"] = opts["sinks"] + 4.0  # comparable to sums of exp over ~600 keys
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_decode(q, k_cache, v_cache, out, tables,
                                 torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5,
                                 opts["window"], opts["softcap"], opts["sinks"], _march=march)
    meta = SimpleNamespace(query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=lens,
                           block_tables=tables)
    check(out, q, k_cache, v_cache, meta, head_dim ** -0.5,
          1e-5 if dtype == torch.float32 else 1e-2, **opts)


def test_long_contexts_in_parts_keep_transformers_greedy_tokens(tmp_path, smollm_tokenizer):
    """End to end through the engine (the decode stack's attention is the same kernel): a
    model of the kernel's fixed shape (head_dim 64, two query heads per KV head) with a
    sliding window of 200, prompts whose decode rows run past one, two and three parts of
    128 tokens, the window starting inside a part: transformers' greedy tokens, batched or
    alone, and no block left in use."""
    from transformers import AutoModelForCausalLM

    from runtime_helpers import hf_greedy, save_tiny_model, tiny_config
    config = tiny_config("mistral", head_dim=64, sliding_window=200)
    path = save_tiny_model(str(tmp_path / "mistral64"), config, smollm_tokenizer)
    prompts = random_prompts(3, lengths=[120, 250, 390], seed=11)
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), prompts,
                     24)
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == want
    assert alone == want
    assert_no_blocks_in_use(llm)


def test_requests_behind_a_long_shared_prompt_keep_transformers_greedy_tokens(
        tmp_path, smollm_tokenizer):
    """End to end, float32: six requests behind one cached 1,050-token prompt (65 blocks:
    past every vector build's cascade minimum) decode together, their shared prefix read
    once in tiles and merged with each tail; then one of them alone, its context past 1,024
    tokens (summed in parts on every vector build). transformers' greedy tokens, request by
    request, and no block left in use."""
    from transformers import AutoModelForCausalLM

    from runtime_helpers import hf_greedy, save_tiny_model, tiny_config
    config = tiny_config("llama", hidden_size=96, head_dim=64, num_attention_heads=6,
                         num_key_value_heads=2, max_position_embeddings=2048)
    path = save_tiny_model(str(tmp_path / "llama64"), config, smollm_tokenizer)
    shared = random_prompts(1, lengths=[1050], seed=12)[0]
    prompts = [shared + tail for tail in random_prompts(6, lengths=[5, 9, 17, 20, 31, 40],
                                                        seed=13)]
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), prompts,
                     16)
    llm = LLM(path, dtype="float32", kv_cache_memory=64 << 20, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([shared], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0].token_ids == want[2]
    assert_no_blocks_in_use(llm)
