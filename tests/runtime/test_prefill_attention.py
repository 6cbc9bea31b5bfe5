"""The AMX prefill attention kernel (native/prefill_attention.cpp) against a float64
reference of the same bfloat16 inputs: within what torch's own bfloat16 SDPA gives on them
(its error, doubled, plus one bfloat16 rounding of the result), for fresh chunks and chunks
over a cached prefix, every shape class the torch backend sends it; the backend sends it
plain causal bfloat16 chunks only, and keeps SDPA elsewhere; bad input names what it takes;
a CPU without AMX says it has no kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quire.attention.base import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend
from quire.native import loader
from quire.native import prefill_attention as pa

with open("/proc/cpuinfo") as _f:
    AMX = " amx_bf16" in _f.read() and "amx" in loader.isa_builds()


def _qkv(length, heads, kv_heads, dim, seed, spread=1.0, ctx=None):
    """q, k, v as views of one projection's rows, as the model makes them; q the last
    `length` of `ctx` positions."""
    ctx = ctx or length
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(ctx, (heads + 2 * kv_heads) * dim, generator=g) * spread).bfloat16()
    q = qkv[ctx - length:, :heads * dim].view(length, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(ctx, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(ctx, kv_heads, dim)
    return q, k, v


def _kernel_here() -> bool:
    """True where this CPU runs the kernel; elsewhere asserts that it says it has none (the
    backend then keeps SDPA), so each test checks one or the other on every host."""
    if not AMX:
        assert not pa.available() and pa._library() is None
    return AMX


def _mask(length, ctx):
    return torch.arange(ctx)[None] <= torch.arange(ctx - length, ctx)[:, None]


def _reference(q, k, v, scale):
    length, heads, _ = q.shape
    group = heads // k.shape[1]
    kd, vd = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = torch.einsum("thd,shd->hts", q.double(), kd) * scale
    s = s.masked_fill(~_mask(length, k.shape[0]), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vd)


def _sdpa(q, k, v, scale):
    length, ctx = q.shape[0], k.shape[0]
    mask = None if length == ctx else _mask(length, ctx)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)


def _assert_as_close_as_sdpa(out, q, k, v, scale):
    want = _reference(q, k, v, scale)
    sdpa = _sdpa(q, k, v, scale).double()
    err = (out.double() - want).abs()
    bound = 2 * (sdpa - want).abs().max() + 2.0 ** -8 * want.abs()
    assert torch.all(err <= bound), f"worst {(err - bound).max().item():.3g} past the bound"
    # and on average no worse than SDPA's (a systematic error hides under the worst case)
    assert err.mean() <= 1.25 * (sdpa - want).abs().mean() + 1e-6


@pytest.mark.parametrize("length, heads, kv_heads, dim, ctx", [
    (1, 9, 3, 64, None), (15, 9, 3, 64, None), (16, 9, 3, 64, None), (17, 9, 3, 64, None),
    (31, 4, 4, 64, None), (33, 8, 1, 32, None), (100, 4, 2, 128, None), (257, 9, 3, 64, None),
    (512, 9, 3, 64, None), (70, 2, 1, 256, None), (30, 4, 2, 96, None),
    # chunks over a cached prefix: the rows are the last of ctx positions
    (1, 9, 3, 64, 40), (64, 9, 3, 64, 300), (5, 4, 2, 96, 77), (100, 4, 1, 64, 129),
    # K/V layouts past the 16 MB the calling thread keeps: the call's own buffer
    (20, 2, 1, 64, 70_000)])
def test_matches_a_float64_reference_as_closely_as_torchs_sdpa(length, heads, kv_heads, dim,
                                                                ctx):
    if not _kernel_here():
        return
    q, k, v = _qkv(length, heads, kv_heads, dim, seed=length * dim + (ctx or 0), ctx=ctx)
    scale = dim ** -0.5
    out = torch.full((length, heads, dim), float("nan"), dtype=torch.bfloat16)
    pa.causal(q, k, v, out, scale)
    _assert_as_close_as_sdpa(out, q, k, v, scale)
    if ctx is None:  # the first row sees one key: its value, exactly
        group = heads // kv_heads
        assert torch.equal(out[0], v[0].repeat_interleave(group, 0))


def test_k_and_v_with_their_own_strides_and_a_strided_out():
    """K normed into its own tensor beside V still in the projection (Qwen3's order), and an
    output that is a view of a wider buffer."""
    if not _kernel_here():
        return
    q, k, v = _qkv(80, 4, 2, 64, seed=9)
    k = k.contiguous()
    wide = torch.full((80, 6, 64), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 1:5]
    pa.causal(q, k, v, out, 0.125)
    _assert_as_close_as_sdpa(out, q, k, v, 0.125)
    assert wide[:, 0].isnan().all() and wide[:, 5].isnan().all()  # nothing past its rows


def test_rows_an_odd_number_of_values_apart():
    """K and V rows whose stride is odd (a projection with one more column): the layout's
    gathers read each pair of d from wherever its row starts; a chunk over a cached prefix
    whose keys end mid-block."""
    if not _kernel_here():
        return
    length, ctx, heads, kv_heads, dim = 40, 101, 4, 2, 64
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ctx, (heads + 2 * kv_heads) * dim + 1, generator=g).bfloat16()
    q = x[ctx - length:, :heads * dim].view(length, heads, dim)
    k = x[:, heads * dim:(heads + kv_heads) * dim].view(ctx, kv_heads, dim)
    v = x[:, (heads + kv_heads) * dim:-1].view(ctx, kv_heads, dim)
    assert k.stride(0) % 2 == 1
    out = torch.empty(length, heads, dim, dtype=torch.bfloat16)
    pa.causal(q, k, v, out, 0.125)
    _assert_as_close_as_sdpa(out, q, k, v, 0.125)


def test_peaked_scores_and_long_rows_keep_their_weights():
    """Scores 30 apart (one key takes nearly everything), rows over many key tiles, scores
    far below the row's max (exp's lower end)."""
    if not _kernel_here():
        return
    q, k, v = _qkv(300, 4, 2, 64, seed=5, spread=6.0)
    out = torch.empty(300, 4, 64, dtype=torch.bfloat16)
    pa.causal(q, k, v, out, 0.125)
    want = _reference(q, k, v, 0.125)
    assert ((out.double() - want).abs() <= 0.02 * want.abs().amax() + 2.0 ** -8 * want.abs()).all()


def test_bad_input_names_what_it_takes():
    q, k, v = _qkv(8, 4, 2, 64, seed=1)
    out = torch.empty(8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        pa.causal(q.float(), k, v, out, 0.125)
    with pytest.raises(ValueError, match="heads contiguous"):
        pa.causal(q.transpose(0, 1), k, v, out, 0.125)
    with pytest.raises(ValueError, match="share a shape"):
        pa.causal(q, k, v[:, :1], out, 0.125)
    with pytest.raises(ValueError, match="fewer than q's 8 rows"):
        pa.causal(q, k[:4], v[:4], out, 0.125)
    with pytest.raises(ValueError, match="scale must be positive"):
        pa.causal(q, k, v, out, 0.0)
    q48, k48, v48 = _qkv(8, 4, 2, 48, seed=1)
    assert not pa.supported(q48, k48, v48)
    if not _kernel_here():
        with pytest.raises(RuntimeError, match="not available"):
            pa.causal(q, k, v, out, 0.125)
        return
    with pytest.raises(ValueError, match="multiple of 32"):
        pa.causal(q48, k48, v48, torch.empty(8, 4, 48, dtype=torch.bfloat16), 0.125)


def test_without_amx_there_is_no_kernel(monkeypatch):
    """Off (no AMX here, or $QUIRE_AMX_ATTENTION=0), supported() is False and the backend
    keeps torch's SDPA; every older build of this CPU compiles and says it has none."""
    q, k, v = _qkv(8, 4, 2, 64, seed=1)
    assert pa.supported(q, k, v) == AMX
    assert not pa.supported(q, k, v[:, :1])
    assert not pa.supported(q.float(), k.float(), v.float())
    monkeypatch.setenv("QUIRE_AMX_ATTENTION", "0")
    assert not pa.supported(q, k, v)
    monkeypatch.setenv("QUIRE_AMX_ATTENTION", "off")
    with pytest.raises(ValueError, match="QUIRE_AMX_ATTENTION must be 0 or 1, got 'off'"):
        pa.supported(q, k, v)
    monkeypatch.setenv("QUIRE_AMX_ATTENTION", "1")
    for march in loader.isa_builds():
        if march != "amx":
            assert pa._library(march) is None, march


def _step(lens, news, heads=6, kv_heads=2, dim=64, bs=16, seed=3):
    """One prefill step: (context, new tokens) per sequence, a cache holding the earlier
    tokens (the new ones are written by forward)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    starts, slots, block = [0], [], 0
    for i, (ctx, new) in enumerate(zip(lens, news)):
        tables[i, : need[i]] = torch.arange(block, block + need[i])
        pos = torch.arange(ctx - new, ctx)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
        block += need[i]
        starts.append(starts[-1] + new)
    k_cache = torch.randn(block, bs, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(block, bs, kv_heads, dim, generator=gen).bfloat16()
    q = torch.randn(starts[-1], heads, dim, generator=gen).bfloat16()
    k = torch.randn(starts[-1], kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(starts[-1], kv_heads, dim, generator=gen).bfloat16()
    meta = AttentionMetadata(
        num_decodes=0, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat(slots), max_query_len=max(news), max_seq_len=max(lens),
        block_size=bs, query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("window", [None, 24])
def test_the_backend_sends_plain_causal_bfloat16_chunks_to_it(monkeypatch, window):
    """Fresh prompts and chunks of 16+ rows over a cached prefix go to the kernel where it
    runs (a long one SDPA would take, a short one the row-walking paged kernel would), and
    match the answer with the kernel off within the bound; a 3-row chunk stays on the paged
    kernel; a sliding window keeps the old paths everywhere."""
    lens, news = [1, 33, 100, 600, 200, 50], [1, 33, 100, 300, 20, 3]
    calls = []
    real = pa.causal
    monkeypatch.setattr(pa, "causal", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))

    def run():
        q, k, v, k_cache, v_cache, meta = _step(lens, news)
        backend = TorchAttentionBackend(6, 2, 64, 0.125, window)
        backend.prepare(meta)
        return backend.forward(q, k, v, k_cache, v_cache, meta)

    got = run()
    assert sorted(calls) == ([] if window or not AMX else [1, 20, 33, 100, 300])
    monkeypatch.setenv("QUIRE_AMX_ATTENTION", "0")
    calls.clear()
    want = run()
    assert calls == []
    if window is None and AMX:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_bfloat16_engine_agrees_with_and_without_the_kernel(tmp_path, family, monkeypatch,
                                                               smollm_tokenizer):
    """A whole bfloat16 engine (heads of 32: the kernel's; Qwen3's q/k norms give K a tensor of
    its own), prompts prefilled in 48-token chunks (later chunks over the cached earlier ones)
    and a shared prefix cached: each prompt token's logprob within bfloat16 noise of the same
    engine with the kernel off, the kernel taking every chunk where it runs, no block left."""
    from quire import LLM, SamplingParams

    from runtime_helpers import assert_no_blocks_in_use, save_tiny_model, tiny_config
    config = tiny_config(family, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32)
    path = save_tiny_model(str(tmp_path / family), config, smollm_tokenizer)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 49152, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    calls = []
    real = pa.causal
    monkeypatch.setattr(pa, "causal", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))

    def run():
        llm = LLM(path, dtype="bfloat16", max_num_batched_tokens=48, kv_cache_memory=8 << 20)
        try:
            llm.generate(prompts[:1], params, use_tqdm=False)  # the shared prefix, cached
            out = llm.generate(prompts, params, use_tqdm=False)
            assert_no_blocks_in_use(llm)
            return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                    for o in out]
        finally:
            llm.engine.shutdown()

    got = run()
    assert bool(calls) == AMX
    monkeypatch.setenv("QUIRE_AMX_ATTENTION", "0")
    calls.clear()
    want = run()
    assert not calls
    for a, b in zip(got, want):
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b)) < 0.1
