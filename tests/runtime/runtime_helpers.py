"""Helpers shared by the runtime tests: tiny random models of each family, prompts, and
transformers' greedy reference (the correctness oracle). Fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import functools
import os
import random

import torch

from quire.models.loader import default_model_path

MODEL_FAMILIES = ("llama", "mistral", "qwen2")
TINY_MAX_NEW_TOKENS = 32


def smollm2_tokenizer():
    """SmolLM2's tokenizer, a copy of each caller's own: one that sets chat_template = None on
    it (tests/scoring) must not change the next test's."""
    import copy
    return copy.deepcopy(_smollm2_tokenizer())


@functools.cache
def _smollm2_tokenizer():
    """SmolLM2's tokenizer from the engine's GGUF conversion cache (saved there from the GGUF
    file's own, made by the first load if missing): 0.3 s, where transformers takes 10 s to
    read it out of the GGUF again in every process and fixture that asks."""
    from transformers import AutoTokenizer

    from quire.models.loader import materialize, resolve_model
    source = materialize(resolve_model(None), "auto")
    if source.kind == "gguf":  # QUIRE_CACHE_DIR="": no cache to read
        folder, name = os.path.split(source.path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(source.path)


def tiny_config(family: str, **overrides):
    """Small enough to run in seconds, big enough to exercise GQA, biases, windows, RoPE."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.08, bos_token_id=1, eos_token_id=2)
    if family in NEW_FAMILIES:  # the test's overrides win over the family's features
        return _new_family_config(family, common, overrides)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**{"rope_theta": 10000.0, **common})
    if family == "mistral":  # a short sliding window, so 300-token prompts cross it
        return MistralConfig(**{"sliding_window": 48, "head_dim": 16, **common})
    if family == "qwen2":    # q/k/v biases, tied embeddings
        return Qwen2Config(**{"tie_word_embeddings": True, **common})
    raise ValueError(family)


# Families whose tiny configs set their special features so that they matter: windows smaller
# than the prompts, soft-caps that clip, multipliers other than 1, long-rope switching inside
# the prompts' range. Their norm weights are randomized too (save_tiny_model), so q/k norms
# and sandwich norms are not the identity.
NEW_FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite")


def _new_family_config(family: str, common: dict, overrides: dict):
    c = {**common, "head_dim": 16}
    config = _new_family_config_class(family, c)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _new_family_config_class(family: str, c: dict):
    import transformers
    if family == "qwen3":
        return transformers.Qwen3Config(**c)
    if family == "gemma2":
        return transformers.Gemma2Config(**{
            **c, "query_pre_attn_scalar": 24, "sliding_window": 32,
            "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0,
            "hidden_activation": "gelu_pytorch_tanh"})
    if family == "gemma3":  # 5 local layers to 1 global, rope scaling on the global one
        return transformers.Gemma3TextConfig(**{
            **c, "num_hidden_layers": 6, "query_pre_attn_scalar": 16, "sliding_window": 32,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})
    if family == "phi3":  # partial rotary; LongRoPE switches to its long table past 64
        rot = 12 // 2
        return transformers.Phi3Config(**{
            **c, "sliding_window": 48, "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rot)],
                "long_factor": [2.0 + 0.5 * i for i in range(rot)],
                "original_max_position_embeddings": 64}})
    if family == "olmo2":
        return transformers.Olmo2Config(**c)
    if family == "granite":
        return transformers.GraniteConfig(**{
            **c, "embedding_multiplier": 6.0, "residual_multiplier": 0.4,
            "attention_multiplier": 0.1, "logits_scaling": 3.0})
    raise ValueError(family)


def save_tiny_model(path: str, config, tokenizer, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(config, "attention_bias", False) or config.model_type == "qwen2":
        with torch.no_grad():  # biases start at zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    if config.model_type not in MODEL_FAMILIES:
        with torch.no_grad():  # norms start at the identity; make them matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_prompts(n: int = 12, lengths=None, seed: int = 0, vocab: int = 49152):
    """Token-id prompts of lengths 1 to 300 (never EOS, so none stops at once)."""
    rng = random.Random(seed)
    lengths = lengths or [1, 2, 7, 15, 16, 17, 33, 64, 100, 150, 257, 300][:n]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding to blur the oracle)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@functools.cache
def smollm2_hf_model():
    """SmolLM2 as transformers itself loads it from the GGUF file (its own dequantization and
    Q/K un-permutation), float32, for every test that needs it. transformers' load of the GGUF
    (~33 s quiet, a minute beside the suite's other worker) is kept in the user's test cache,
    keyed by the file and transformers' version (its config as transformers writes it, its
    tensors as safetensors does); later processes and runs read it back (~0.5 s), the same
    tensors. A lock makes the second of two workers wait for the first's copy."""
    import copy
    import fcntl
    import shutil

    import safetensors.torch
    path = default_model_path()
    saved = os.path.join(_test_tools(), f"smollm2-hf-{_smollm2_key()}")
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(saved, ".complete")):
            folder, name = os.path.split(path)
            model = hf_model(folder, gguf_file=name)
            tmp = f"{saved}.tmp-{os.getpid()}"
            # (save_pretrained refuses a model loaded from a GGUF: its config carries the
            # GGUF quantizer's settings; the tensors themselves are plain float32)
            config = copy.deepcopy(model.config)
            with contextlib.suppress(AttributeError):
                del config.quantization_config
            config.save_pretrained(tmp)
            safetensors.torch.save_model(model, os.path.join(tmp, "model.safetensors"))
            open(os.path.join(tmp, ".complete"), "w").close()
            shutil.rmtree(saved, ignore_errors=True)  # one cut short by a killed run
            os.replace(tmp, saved)
            return model
    return hf_model(saved)


def _test_tools() -> str:
    root = os.path.join(os.path.expanduser("~"), ".cache", "quire", "test-tools")
    os.makedirs(root, exist_ok=True)
    return root


def _smollm2_key(*more: str) -> str:
    """The default GGUF's content and transformers' version, and `more`, hashed. The content,
    not the file's path: the GGUF lies in each checkout's virtual environment, and a fresh
    clone's suite would compute the same oracle again (~3 minutes of a core on a Zen 1 EPYC)."""
    import hashlib

    import transformers
    text = ":".join([_gguf_digest(default_model_path()), transformers.__version__, *more])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def _gguf_digest(path: str) -> str:
    import hashlib
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # (~0.3 s for its 98 MB)


def smollm2_hf_greedy(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy on smollm2_hf_model (~25 s quiet for the 12 SMOLLM_PROMPTS), kept in the test
    cache as JSON: transformers' own tokens, computed once per model, transformers and torch
    version, CPU (its model and flags: torch's float32 kernels, so their rounding, follow
    them) and prompts; the second of two workers waits for the first's."""
    import fcntl
    import json

    from quire.native.loader import _cpu_signature  # what the kernel cache keys on, too
    saved = os.path.join(_test_tools(), "smollm2-greedy-" + _smollm2_key(
        torch.__version__, _cpu_signature(), json.dumps(prompts), str(max_new_tokens)) + ".json")
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(saved):
            with open(saved) as f:
                return json.load(f)
        outs = hf_greedy(smollm2_hf_model(), prompts, max_new_tokens)
        with open(saved + ".tmp", "w") as f:
            json.dump(outs, f)
        os.replace(saved + ".tmp", saved)
        return outs


def hf_model(path: str, **kwargs):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


SMOLLM_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
    "Translate to French: Good morning, how are you today?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Question: What is the boiling point of water at sea level? Answer:",
    "Write a haiku about autumn leaves falling gently.",
    "In mathematics, a prime number is " * 6,
    "Paris is a city in France. " * 20,
    "The history of the Roman Empire spans many centuries and " * 25,
]
SMOLLM_MAX_NEW_TOKENS = 24


def assert_no_blocks_in_use(llm) -> None:
    pool = llm.engine.kv_manager.pool
    assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} KV blocks still in use"


@contextlib.contextmanager
def step_limit(engine, max_steps: int):
    """Fail, instead of hanging, if the engine takes more than max_steps steps (a count, so
    the limit means the same on any machine)."""
    step, count = engine.step, [0]

    def limited():
        count[0] += 1
        assert count[0] <= max_steps, f"still unfinished after {max_steps} steps: spinning"
        return step()
    engine.step = limited
    try:
        yield count
    finally:
        engine.step = step


def run_triton_interpreter_suite(suite, tmp_path) -> int:
    """Run a Triton kernel suite under TRITON_INTERPRET=1 in a child pytest (the interpreter
    must be on before triton is imported), fail with its output if any case fails, and
    return how many cases passed (the caller asserts the suite did not shrink to nothing)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'suite'}", "--durations=5"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=900)
    print(child.stdout[-4000:])
    assert child.returncode == 0, f"interpreter suite failed:\n{child.stdout[-12000:]}\n" \
                                  f"{child.stderr[-3000:]}"
    summary = child.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary, summary
    return int(re.search(r"(\d+) passed", summary).group(1))
