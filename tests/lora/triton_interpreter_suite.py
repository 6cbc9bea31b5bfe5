"""The LoRA Triton kernels (shrink, expand) against the torch path, in Triton's CPU
interpreter.

Not collected by pytest on its own (no test_ prefix): test_lora_triton.py runs it in a child
process with TRITON_INTERPRET=1, for the reason tests/runtime/test_triton_backend.py gives
(Triton fixes interpreter-or-compiler when it is first imported). To see each case:

    TRITON_INTERPRET=1 python -m pytest tests/lora/triton_interpreter_suite.py --durations=0
"""

from __future__ import annotations

import os

# CI: the interpreter on CPU tensors; QUIRE_TRITON_DEVICE=cuda: compiled on a GPU.
DEVICE_TYPE = os.environ.get("QUIRE_TRITON_DEVICE", "cpu")
if DEVICE_TYPE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module in a fresh process with TRITON_INTERPRET=1 "
                       "(see tests/lora/test_lora_triton.py), or on a GPU with "
                       "QUIRE_TRITON_DEVICE=cuda")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from quire.lora import triton_ops  # noqa: E402
from quire.lora.batch import build_lora_batch  # noqa: E402
from quire.lora.ops import add_lora_torch  # noqa: E402

# Largest error allowed, relative to the largest output (~5-25 here). fp32: both sides sum in
# fp32, in another order. fp16/bf16: u and the delta are rounded to the activation dtype on
# both sides, so a one-ulp difference in u (summation order) moves the output by an ulp or
# two of its largest values, and cancellation makes elementwise relative errors meaningless.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 3e-2}  # bf16: ~4 ulps


def test_kernels_run_in_the_interpreter():
    interpreted = type(triton_ops._shrink_kernel).__name__ == "InterpretedFunction"
    assert interpreted == (DEVICE_TYPE != "cuda")


def _case(t, k, width, n, num_slots, slots_of_rows, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(DEVICE_TYPE, dtype)
    y = torch.randn(t, n, generator=gen).to(DEVICE_TYPE, dtype)
    a = (torch.randn(num_slots, k, width, generator=gen) * 0.3).to(DEVICE_TYPE, dtype)
    b = (torch.randn(num_slots, width, n, generator=gen) * 0.3).to(DEVICE_TYPE, dtype)
    batch = build_lora_batch(np.asarray(slots_of_rows, dtype=np.int64),
                             torch.device(DEVICE_TYPE), use_triton=True)
    return x, y, a, b, batch


def _rows(t, num_slots, seed, base_share=0.3):
    rng = np.random.default_rng(seed)
    return np.where(rng.random(t) < base_share, -1, rng.integers(0, num_slots, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,width,n,num_slots", [
    (1, 64, 16, 64, 1),        # one decode row
    (37, 96, 24, 130, 3),      # K past a BLOCK_K multiple, width and N not powers of two
    (70, 64, 48, 192, 4),      # segments longer than BLOCK_M (several row tiles each)
])
def test_shrink_expand_match_torch(dtype, t, k, width, n, num_slots):
    rows = _rows(t, num_slots, seed=t)
    if not (rows >= 0).any():
        rows[0] = 0
    x, y, a, b, batch = _case(t, k, width, n, num_slots, rows, dtype)
    want = add_lora_torch(y.clone(), x, a, b, batch)
    got = triton_ops.add_lora_triton(y.clone(), x, a, b, batch)
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err} on outputs up to {scale}"
    base = torch.from_numpy(rows < 0).to(DEVICE_TYPE)
    assert torch.equal(got[base], y[base]), "base-model rows must be left untouched"


def test_shrink_alone_matches_torch():
    rows = _rows(29, 3, seed=5, base_share=0.0)
    x, _, a, _, batch = _case(29, 80, 32, 16, 3, rows, torch.float32)
    u = triton_ops.lora_shrink(x, a, batch)
    for slot, start, end in batch.segments:
        want = x[batch.perm[start:end]] @ a[slot]
        torch.testing.assert_close(u[start:end], want, atol=1e-5, rtol=1e-5)


def test_one_adapter_for_the_whole_batch():
    x, y, a, b, batch = _case(33, 64, 16, 96, 2, [1] * 33, torch.float32)
    assert batch.whole
    want = y + (x @ a[1]) @ b[1]
    got = triton_ops.add_lora_triton(y.clone(), x, a, b, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_engine_with_triton_gives_the_torch_paths_tokens(tmp_path):
    """A whole engine on the Triton attention backend (and so the LoRA kernels), base and two
    adapters mixed in one batch, against the same engine on torch."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from quire import LLM, LoRARequest, SamplingParams

    from lora_helpers import (
        random_prompts,
        save_random_adapter,
        save_tiny_model,
        smollm2_tokenizer,
        tiny_config,
    )
    base = save_tiny_model(str(tmp_path / "base"), tiny_config("llama", num_hidden_layers=2),
                           smollm2_tokenizer())
    loras = [LoRARequest("a", 1, save_random_adapter(base, str(tmp_path / "a"), r=8, seed=1)),
             LoRARequest("b", 2, save_random_adapter(base, str(tmp_path / "b"), r=4, seed=2,
                                                     targets=["q_proj", "v_proj", "up_proj"]))]
    prompts = random_prompts(6, lengths=[3, 17, 40, 5, 33, 9], seed=3)
    per_prompt = [None, loras[0], loras[1]] * 2
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(base, dtype="float32", attention_backend=backend, enable_lora=True,
                  max_loras=2, kv_cache_memory=4 << 20, max_num_batched_tokens=32,
                  device=DEVICE_TYPE)
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                           lora_request=per_prompt, use_tqdm=False)
        outs[backend] = [o.outputs[0].token_ids for o in res]
        assert llm.engine.lora.manager.use_triton == (backend == "triton")
    assert outs["triton"] == outs["torch"]
