"""The Triton kernels against the torch reference backend (with soft-capping and sinks,
against transformers' eager order), in Triton's CPU interpreter.

Not collected by pytest on its own (no test_ prefix): test_triton_backend.py runs it in a
child process with TRITON_INTERPRET=1, because Triton fixes interpreter-or-compiler for its
own standard library when triton is first imported, and in a full test session something
(torch._dynamo, via transformers) has usually imported it long before. To see each case:

    TRITON_INTERPRET=1 python -m pytest tests/runtime/triton_interpreter_suite.py --durations=0
"""

from __future__ import annotations

import os
import random

# CI runs the suite in the interpreter on CPU tensors; QUIRE_TRITON_DEVICE=cuda runs the same
# cases compiled on a GPU (benchmarks/cuda_check.sh).
DEVICE_TYPE = os.environ.get("QUIRE_TRITON_DEVICE", "cpu")
if DEVICE_TYPE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module in a fresh process with TRITON_INTERPRET=1 "
                       "(see tests/runtime/test_triton_backend.py), or on a GPU with "
                       "QUIRE_TRITON_DEVICE=cuda")

import pytest  # noqa: E402
import torch  # noqa: E402

from quire.attention import triton_backend  # noqa: E402
from quire.attention.base import AttentionMetadata  # noqa: E402
from quire.attention.torch_backend import TorchAttentionBackend, write_kv  # noqa: E402
from quire.attention.triton_kernels.cache_write import write_kv_cache  # noqa: E402
from quire.attention.triton_kernels.common import is_interpreted  # noqa: E402

from attention_reference import OPTIONS, check, options  # noqa: E402

DEVICE = torch.device(DEVICE_TYPE)
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Output tolerance (absolute, relative) against the torch backend, on outputs of magnitude
# ~1-4. fp32: both sides accumulate in fp32, in a different order (errors seen: <= 2e-6).
# fp16/bf16 (errors seen: one ulp): the reference rounds the probabilities to the activation
# dtype before P @ V where the kernels keep fp32 (bf16 tiles are upcast to fp32 for tl.dot,
# see triton_kernels/common.py), and the interpreter truncates rather than rounds
# fp32 -> bf16 when it stores the output. Both allow about two ulps.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3),
             torch.bfloat16: (8e-3, 1.6e-2)}


def test_kernels_run_in_the_interpreter():
    """Ours and Triton's own library (tl.max, tl.sum, ...), which it defines on import; on a
    GPU, neither is interpreted."""
    import triton.language.standard as tl_standard
    interpreted = DEVICE.type != "cuda"
    assert triton_backend.INTERPRETED == interpreted
    assert is_interpreted(tl_standard.max) == interpreted, \
        "triton was imported before TRITON_INTERPRET=1"


def fused_qkv(t, h, hkv, d, dtype, gen):
    """q, k, v as strided views of one fused projection, as the model hands them over."""
    fused = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = fused.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)


# ------------------------------------------------------------------------------ cache write

@pytest.mark.parametrize("dtype,kv,scale", [
    (torch.float32, None, 1.0), (torch.float16, None, 1.0), (torch.bfloat16, None, 1.0),
    (torch.float32, "e4m3", 0.37), (torch.float32, "e5m2", 3.1),
    (torch.float16, "e4m3", 0.37), (torch.bfloat16, "e5m2", 1.7),
])
def test_cache_write_stores_the_same_bytes_as_torch(dtype, kv, scale):
    gen = torch.Generator().manual_seed(0)
    t, hkv, d, bs, blocks = 37, 3, 64, 8, 12
    cache_dtype = FP8[kv] if kv else dtype
    _, k, v = fused_qkv(t, 1, hkv, d, torch.float32, gen)
    if kv:  # fp8 subnormals, round-up carries, and past the largest finite value (saturates)
        k = k * torch.exp2(torch.randint(-24, 18, k.shape, generator=gen).float())
        k = k.clamp(-6e4, 6e4)   # within fp16's range
    k, v = k.to(DEVICE, dtype), v.to(DEVICE, dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:t].to(DEVICE)
    got = [torch.zeros(blocks, bs, hkv, d, dtype=cache_dtype, device=DEVICE)
           for _ in range(2)]
    want = [torch.zeros_like(got[0]) for _ in range(2)]
    write_kv_cache(k, v, *got, slots, scale, scale)
    write_kv(k, v, *want, slots, scale, scale)
    for g, w in zip(got, want):
        g, w = g.view(torch.uint8).cpu(), w.view(torch.uint8).cpu()
        bad = (g != w).nonzero()
        assert not len(bad), (f"{len(bad)} bytes differ; first at {bad[0].tolist()}: "
                              f"{g[tuple(bad[0])]} stored, torch stores {w[tuple(bad[0])]}")


# -------------------------------------------------------------------------- paged attention

def decodes_and_prefills(bs: int):
    """(context length, query length) per sequence, decodes first: contexts at and around
    block boundaries (len % bs = 0, 1, bs - 1), a fresh prompt, and chunks extending a
    cached prefix that end on, just past and just before a block boundary."""
    decodes = [(1, 1), (bs, 1), (bs + 1, 1), (2 * bs - 1, 1), (3 * bs, 1)]
    prefills = [(2 * bs + 1, 2 * bs + 1), (3 * bs, bs - 1), (4 * bs - 1, 2 * bs)]
    return decodes + prefills


def paged_batch(seqs, h, hkv, d, dtype, bs, cache_dtype, k_scale, v_scale, seed=0):
    """Random q/k/v for the new tokens, a cache holding every sequence's earlier tokens in
    shuffled (non-contiguous) blocks among junk-filled spare ones, and its metadata."""
    seqs = sorted(seqs, key=lambda s: s[1] != 1)   # decodes first, as the engine orders them
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-ctx // bs) for ctx, _ in seqs]
    num_blocks = sum(need) + 4
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)])
    # finite junk in every slot: attention that reads a slot it shouldn't will show
    caches = [(torch.randn(num_blocks, bs, hkv, d, generator=gen) * 8).to(cache_dtype)
              for _ in range(2)]

    def slots(i, positions):
        pos = torch.tensor(positions, dtype=torch.int64)
        return tables[i, pos // bs].long() * bs + pos % bs

    for i, (ctx, ql) in enumerate(seqs):   # the cached prefix
        if ctx > ql:
            _, k, v = fused_qkv(ctx - ql, 1, hkv, d, dtype, gen)
            write_kv(k, v, *caches, slots(i, range(ctx - ql)), k_scale, v_scale)
    qls = [ql for _, ql in seqs]
    q, k, v = fused_qkv(sum(qls), h, hkv, d, dtype, gen)
    qsl = [0]
    for ql in qls:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        num_decodes=sum(ql == 1 for ql in qls),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat([slots(i, range(ctx - ql, ctx))
                                for i, (ctx, ql) in enumerate(seqs)]),
        max_query_len=max(qls), max_seq_len=max(ctx for ctx, _ in seqs), block_size=bs,
        query_start_loc_cpu=qsl, seq_lens_cpu=[ctx for ctx, _ in seqs])
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), [c.to(DEVICE) for c in caches], meta


def fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(**{**meta.__dict__, "backend_state": {}})


def dequantized(cache, dtype, scale):
    return cache.to(dtype) * scale if cache.dtype != dtype else cache.clone()


def run_both(seqs, h, hkv, d, dtype=torch.float32, bs=16, window=None, kv=None,
             k_scale=1.0, v_scale=1.0, splits=None):
    """Triton and torch backends on the same step; returns (triton out, torch out, triton
    caches, torch caches). fp8: the torch side attends over the dequantized cache and over
    new K/V already rounded through fp8, since the kernels read K/V only from the cache."""
    cache_dtype = FP8[kv] if kv else dtype
    q, k, v, caches, meta = paged_batch(seqs, h, hkv, d, dtype, bs, cache_dtype,
                                        k_scale, v_scale)
    scale = d ** -0.5
    triton_attn = triton_backend.TritonAttentionBackend(h, hkv, d, scale, window)
    if splits:   # lower the split policy so short contexts still split
        triton_attn.min_split_len, triton_attn.target_decode_programs = splits
    torch_attn = TorchAttentionBackend(h, hkv, d, scale, window)

    ours = [c.clone() for c in caches]
    m1 = fresh(meta)
    triton_attn.prepare(m1)
    out = triton_attn.forward(q, k, v, *ours, m1, k_scale, v_scale)

    ref_caches = [dequantized(c, dtype, s) for c, s in zip(caches, (k_scale, v_scale))]
    rk, rv = k, v
    if kv:
        rk = (k.float() / k_scale).to(cache_dtype).to(dtype) * k_scale
        rv = (v.float() / v_scale).to(cache_dtype).to(dtype) * v_scale
    m2 = fresh(meta)
    torch_attn.prepare(m2)
    ref = torch_attn.forward(q, rk, rv, *ref_caches, m2)
    return out, ref, ours, ref_caches, m1


def assert_close(out, ref, dtype, meta):
    atol, rtol = TOLERANCE[dtype]
    excess = (out.float() - ref.float()).abs() - rtol * ref.float().abs()
    worst = excess.amax(dim=(1, 2))   # per token
    bad = (~(worst <= atol)).nonzero().flatten().tolist()   # NaN fails too
    assert not bad, (f"tokens {bad} (decodes are 0..{meta.num_decodes - 1}) are off by "
                     f"{worst.max().item():.3g} beyond rtol {rtol}, over atol {atol}")


CASES = {
    # name: (num_heads, num_kv_heads, head_dim, dtype, block_size)
    "gqa1-d128-fp32": (2, 2, 128, torch.float32, 16),
    "gqa3-d64-fp32": (6, 2, 64, torch.float32, 16),
    "gqa8-d128-fp32-bs8": (8, 1, 128, torch.float32, 8),
    "gqa8-d64-fp32-bs32": (8, 1, 64, torch.float32, 32),
    "gqa3-d64-fp16": (6, 2, 64, torch.float16, 16),
    "gqa8-d64-bf16": (8, 1, 64, torch.bfloat16, 16),
    "gqa2-d256-fp32": (4, 2, 256, torch.float32, 16),
    "gqa2-d80-fp16-bs2": (4, 2, 80, torch.float16, 2),   # padded head_dim, tiny blocks
}


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_batch_matches_torch(case):
    h, hkv, d, dtype, bs = CASES[case]
    out, ref, ours, ref_caches, meta = run_both(decodes_and_prefills(bs), h, hkv, d, dtype, bs)
    assert_close(out, ref, dtype, meta)
    for a, b in zip(ours, ref_caches):   # the cache write inside forward
        assert torch.equal(a, b)


def test_sliding_window_matches_torch():
    """Mistral-style: contexts longer than the window, windows starting mid-block, a chunk
    whose window starts inside the cached prefix."""
    bs, window = 8, 20
    seqs = [(5, 1), (20, 1), (21, 1), (45, 1), (50, 50), (60, 10), (41, 17)]
    out, ref, *_, meta = run_both(seqs, 6, 2, 64, torch.float32, bs, window=window)
    assert_close(out, ref, torch.float32, meta)


@pytest.mark.parametrize("window,dtype,kv", [
    (None, torch.float32, None), (70, torch.float16, "e5m2")])
def test_long_decodes_split_and_reduce(window, dtype, kv):
    """Context split across programs, including splits left empty by short sequences, then
    merged by the reduction kernel."""
    seqs = [(1, 1), (100, 1), (129, 1), (200, 1), (40, 8)]
    out, ref, *_, meta = run_both(seqs, 8, 1, 64, dtype, 16, window=window, kv=kv,
                                  k_scale=0.5, v_scale=2.0, splits=(16, 32))
    assert meta.backend_state[next(iter(meta.backend_state))].num_splits > 3
    assert_close(out, ref, dtype, meta)


@pytest.mark.parametrize("kv,dtype,k_scale,v_scale", [
    ("e4m3", torch.float32, 0.05, 0.02),
    ("e5m2", torch.float16, 0.5, 2.0),
])
def test_fp8_cache_matches_torch(kv, dtype, k_scale, v_scale):
    out, ref, ours, ref_caches, meta = run_both(decodes_and_prefills(16), 6, 2, 64, dtype, 16,
                                                kv=kv, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, ref, dtype, meta)
    for a, b, s in zip(ours, ref_caches, (k_scale, v_scale)):
        assert torch.equal(a.to(dtype) * s, b)


@pytest.mark.parametrize("splits", [None, (16, 32)])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_soft_capping_and_sinks_match_eager_attention(option, splits):
    """Decodes (with context splits: the sink counts once, in split 0), fresh prompts and
    chunks over a cached prefix, against transformers' eager order in float32 (the torch
    backend would run the same native kernels as on the CPU: the reference is written out
    instead). Windows shorter than the longer contexts."""
    h, hkv, d, bs = 6, 2, 32, 8
    seqs = [(1, 1), (17, 1), (40, 1), (70, 1), (30, 30), (45, 12), (20, 5)]
    q, k, v, caches, meta = paged_batch(seqs, h, hkv, d, torch.float32, bs, torch.float32,
                                        1.0, 1.0)
    opts = options(option, h, DEVICE)
    attn = triton_backend.TritonAttentionBackend(h, hkv, d, d ** -0.5, opts["window"],
                                                 opts["softcap"])
    if splits:
        attn.min_split_len, attn.target_decode_programs = splits
    attn.prepare(meta)
    assert (meta.backend_state[attn].num_splits > 1) == bool(splits)
    out = attn.forward(q, k, v, *caches, meta, sinks=opts["sinks"])
    check(out, q, *caches, meta, d ** -0.5, 1e-5, **opts)


@pytest.mark.parametrize("window", [None, 5])
def test_image_runs_looking_ahead_match_eager_attention(window):
    """Key limits (Gemma 3's image runs attend both ways, base.py): a fresh prompt with two
    runs, one across a query tile's edge; a chunk starting inside a run (after a prefix hit);
    a decode and a chunk with none ahead. Against the dense reference; the limits move every
    row that looks ahead, and only those."""
    import numpy as np

    from quire.multimodal.image_attention import key_limits
    from quire.multimodal.inputs import ImageSpan

    from attention_reference import paged_reference
    h, hkv, d, bs = 6, 2, 32, 8
    seqs = [(17, 1), (40, 40), (45, 20), (30, 12)]
    runs = [[], [ImageSpan("a" * 64, 3, 9), ImageSpan("b" * 64, 20, 16)],
            [ImageSpan("b" * 64, 20, 16)], []]
    q, k, v, caches, meta = paged_batch(seqs, h, hkv, d, torch.float32, bs, torch.float32,
                                        1.0, 1.0)
    own = [key_limits(r, ctx - ql, ql) for (ctx, ql), r in zip(seqs, runs)]
    limits = np.concatenate([np.arange(ctx - ql, ctx) if lim is None else lim
                             for (ctx, ql), lim in zip(seqs, own)])
    meta.key_limits = torch.from_numpy(limits.astype(np.int32)).to(DEVICE)
    attn = triton_backend.TritonAttentionBackend(h, hkv, d, d ** -0.5, window)
    assert attn.block_q < 36  # the run [20, 36) crosses a query tile's edge
    attn.prepare(meta)
    out = attn.forward(q, k, v, *caches, meta)
    check(out, q, *caches, meta, d ** -0.5, 1e-5, window=window)
    want = paged_reference(q, *caches, meta, d ** -0.5, window=window)
    causal = paged_reference(q, *caches, AttentionMetadata(**{**meta.__dict__,
                                                               "key_limits": None}),
                             d ** -0.5, window=window)
    moved = (want - causal).abs().amax(dim=(1, 2))
    ahead = torch.from_numpy(limits) > torch.cat([torch.arange(c - n, c) for c, n in seqs])
    assert (moved[ahead] > 1e-3).all() and (moved[~ahead] == 0).all()


# ------------------------------------------------------------------------------- the engine

VOCAB = 512


def word_tokenizer():
    """A word-level tokenizer over VOCAB ids: builds in milliseconds, where loading the
    SmolLM2 one from its GGUF file takes half a minute."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                                   eos_token="w2")


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_engine_greedy_tokens_equal_torch_backend(family, tmp_path):
    """Chunked prefill (a 40-token budget, so chunks end mid-block) and prefix-cache hits
    (a second batch reusing the first one's prompts) both go through the prefill kernel;
    Mistral's 48-token window is crossed by the longer prompts."""
    from quire import LLM, SamplingParams
    from quire.worker.kv_cache import bytes_per_block

    from runtime_helpers import random_prompts, save_tiny_model, tiny_config

    config = tiny_config(family, vocab_size=VOCAB, num_hidden_layers=2)
    path = save_tiny_model(str(tmp_path / family), config, word_tokenizer())
    first = random_prompts(lengths=[1, 9, 40, 75, 130], vocab=VOCAB)
    extra = random_prompts(lengths=[3, 20], seed=1, vocab=VOCAB)
    second = [first[3][:64] + extra[0], first[4][:100] + extra[1]]
    params = SamplingParams(temperature=0, max_tokens=6)
    kv_bytes = 120 * bytes_per_block(2, 16, config.num_key_value_heads, 16, torch.float32)

    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", attention_backend=backend, kv_cache_memory=kv_bytes,
                  max_num_batched_tokens=40, device=DEVICE.type)
        assert llm.engine.attention_backend == backend
        tokens = [o.outputs[0].token_ids
                  for batch in (first, second) for o in llm.generate(batch, params, use_tqdm=False)]
        results[backend] = tokens, llm.engine.kv_manager.prefix_hits
    assert results["triton"][1] >= 64 + 96   # the second batch hit the prefix cache
    assert results["triton"] == results["torch"]


def test_gemma3_image_prompts_give_the_torch_backend_tokens(tmp_path):
    """Gemma 3 with images (runs that attend both ways, sliding and global layers): chunks
    cut before runs (an 18-token budget) and a prefix hit ending inside a run, through the
    prefill kernel's key limits."""
    from quire import LLM, SamplingParams

    from gemma3_helpers import BOI, save_tiny_gemma3  # tests/multimodal, on the pythonpath
    from mm_helpers import random_image
    path = save_tiny_gemma3(str(tmp_path / "gemma3"))
    image, other = random_image(0), random_image(1, (64, 64))
    batches = [
        [{"prompt": f"Compare {BOI} with {BOI} please.", "multi_modal_data":
          {"image": [image, other]}},
         {"prompt": f"Some words here: {BOI} end.", "multi_modal_data": {"image": image}}],
        [{"prompt": f"Some words here: {BOI} and a different ending.",
          "multi_modal_data": {"image": image}}],   # hits the blocks up to 16: inside the run
    ]
    params = SamplingParams(temperature=0, max_tokens=4)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", attention_backend=backend, max_num_batched_tokens=18,
                  device=DEVICE.type)
        results[backend] = [o.outputs[0].token_ids for batch in batches
                            for o in llm.generate(batch, params, use_tqdm=False)]
        assert llm.engine.kv_manager.prefix_hits >= 16
    assert results["triton"] == results["torch"]
