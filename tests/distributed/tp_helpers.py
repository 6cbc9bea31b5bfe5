"""Helpers for the tensor-parallel tests: the runtime tests' tiny models (loaded by path, as
tests/server does), the KV budget for a number of blocks per rank, and /proc scans for the
processes a test must not leave behind."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TP = 2

# family -> tiny config overrides: qwen2 with one KV head, so two ranks replicate it; OLMo 2
# too (its k norm spans the whole projection: a replicated head must count once)
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {"num_key_value_heads": 1}, "qwen3": {},
            "gemma3": {}, "olmo2": {"num_key_value_heads": 1}}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runtime_helpers = _load("runtime_helpers", ROOT / "tests" / "runtime" / "runtime_helpers.py")
moe_helpers = _load("moe_helpers", ROOT / "tests" / "runtime" / "moe_helpers.py")


def shared_prefix_prompts():
    """Prompts of 1-300 tokens and two that share a long prefix with the longest."""
    prompts = runtime_helpers.random_prompts(6, lengths=[1, 17, 64, 150, 257, 300], seed=7)
    return prompts + [prompts[-1][:200] + [11, 12, 13], list(prompts[-1])]


def kv_budget_for(hf_config, num_blocks: int, tp: int, block_size: int = 16,
                  pp: int = 1) -> int:
    """kv_cache_memory (per rank) that holds num_blocks blocks of rank 0's KV heads (of its
    pipeline stage's layers)."""
    from quire.parallel_state import kv_heads_per_rank, partition_layers
    from quire.worker.kv_cache import bytes_per_block
    head_dim = (getattr(hf_config, "head_dim", None)
                or hf_config.hidden_size // hf_config.num_attention_heads)
    kv_heads = kv_heads_per_rank(hf_config.num_key_value_heads, tp)
    layers = partition_layers(hf_config.num_hidden_layers, pp)[0]
    return num_blocks * bytes_per_block(layers, block_size, kv_heads, head_dim, torch.float32)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float) -> list[int]:
    """Polls until none of pids runs; returns those still running at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _children(parent: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of parent's running children."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and alive(int(entry)):
            found.append((int(entry), cmdline))
    return found


def worker_processes(parent: int) -> list[int]:
    """The worker processes `parent` started (quire/distributed/start_method.py): the children
    of its fork server (not the server itself, nor the resource tracker)."""
    servers = [pid for pid, cmdline in _children(parent)
               if b"multiprocessing.forkserver" in cmdline]
    return sorted(pid for server in servers for pid, _ in _children(server))


def assert_two_ranks_match_transformers(path: str, hf_config, prompts, max_tokens: int,
                                        check_engine=None, tp: int = TP, pp: int = 1,
                                        **engine_kwargs) -> None:
    """tp x pp ranks (two tensor ranks by default) with 64-token chunks, prefix caching and a
    KV budget that preempts give transformers' greedy output for every prompt, with a
    preemption, a prefix hit and no block left in use; `check_engine(engine)` adds a
    caller's checks before shutdown; `engine_kwargs` more LLM(...) keywords."""
    from quire import LLM, SamplingParams
    expected = runtime_helpers.hf_greedy(runtime_helpers.hf_model(path), prompts, max_tokens)
    need = -(-(max(map(len, prompts)) + max_tokens) // 16)  # blocks of the longest request
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              num_threads=1, kv_cache_memory=kv_budget_for(hf_config, need + 4, tp, pp=pp),
              max_num_batched_tokens=64, enable_prefix_caching=True, **engine_kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                            use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"prompt {i} (len {len(prompts[i])}) diverges from transformers"
        engine = llm.engine
        assert engine.scheduler.num_preemptions["recompute"] > 0, "no preemption happened"
        assert engine.kv_manager.prefix_hits > 0, "no prefix-cache hit happened"
        assert max(map(len, prompts)) > 64  # so prefills were chunked
        assert engine.kv_manager.pool.num_used_blocks == 0
        if check_engine is not None:
            check_engine(engine)
    finally:
        llm.engine.shutdown()
