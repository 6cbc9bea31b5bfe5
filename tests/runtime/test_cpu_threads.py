"""Threads from the CPU quota the process really has: fake cgroup trees and affinity sets."""

from __future__ import annotations

import logging

import pytest
import torch

from quire import cpu_threads
from quire.cpu_threads import CpuQuota, configure_threads, detect_quota, resolve_threads

from runtime_helpers import save_tiny_model, tiny_config


def cgroup_v2(tmp_path, path: str, limits: dict[str, str]):
    """A cgroup2 mount at tmp_path/cg; `limits` maps a cgroup path ("" = the mount) to the
    text of its cpu.max. Returns (root, the /proc/self/cgroup file)."""
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for where, text in limits.items():
        (root / where.lstrip("/") / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{path}\n")
    return str(root), str(proc)


def cgroup_v1(tmp_path, path: str, quota: int, period: int, mount: str = "cpu,cpuacct"):
    root = tmp_path / "cg"
    here = root / mount / path.lstrip("/")
    here.mkdir(parents=True)
    (here / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (here / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"12:memory:{path}\n4:cpu,cpuacct:{path}\n0::/\n")
    return str(root), str(proc)


def test_v2_cpu_max_rounds_up(tmp_path):
    root, proc = cgroup_v2(tmp_path, "/", {"": "150000 100000"})
    q = detect_quota(root, proc, affinity=set(range(16)))
    assert (q.cgroup, q.cgroup_source, q.affinity) == (1.5, "cpu.max", 16)
    assert q.cpus == 2  # 1.5 CPUs of quota: two threads share it
    assert q.describe() == "cgroup cpu.max 1.5, affinity 16 cpus"


def test_v2_tightest_limit_on_the_path_wins(tmp_path):
    # kubepods (8 CPUs) > the pod (3) > the container (max): the pod's limit holds
    root, proc = cgroup_v2(tmp_path, "/kubepods/pod1/ctr", {
        "/kubepods": "800000 100000", "/kubepods/pod1": "300000 100000",
        "/kubepods/pod1/ctr": "max 100000"})
    assert detect_quota(root, proc, affinity=set(range(64))).cpus == 3


def test_v2_unlimited_falls_back_to_affinity(tmp_path):
    root, proc = cgroup_v2(tmp_path, "/", {"": "max 100000"})
    q = detect_quota(root, proc, affinity={0, 2, 5})
    assert q.cgroup is None and q.cpus == 3
    assert q.describe() == "cgroup no CPU limit, affinity 3 cpus"


def test_affinity_tighter_than_quota(tmp_path):
    root, proc = cgroup_v2(tmp_path, "/", {"": "400000 100000"})
    assert detect_quota(root, proc, affinity={1, 3}).cpus == 2


def test_v2_namespace_path_missing_reads_the_mount(tmp_path):
    # /proc/self/cgroup names a path this mount does not have (a cgroup namespace)
    root, proc = cgroup_v2(tmp_path, "/", {"": "200000 100000"})
    (tmp_path / "proc_cgroup").write_text("0::/system.slice/elsewhere.scope\n")
    assert detect_quota(root, proc, affinity=set(range(8))).cpus == 2


def test_tiny_quota_still_one_thread(tmp_path):
    root, proc = cgroup_v2(tmp_path, "/", {"": "10000 100000"})
    q = detect_quota(root, proc, affinity=set(range(8)))
    assert q.cgroup == pytest.approx(0.1) and q.cpus == 1


def test_v1_cfs_quota(tmp_path):
    root, proc = cgroup_v1(tmp_path, "/docker/abc", 250000, 100000)
    q = detect_quota(root, proc, affinity=set(range(8)))
    assert (q.cgroup, q.cgroup_source, q.cpus) == (2.5, "cpu.cfs_quota_us", 3)


def test_v1_unlimited_quota(tmp_path):
    root, proc = cgroup_v1(tmp_path, "/", -1, 100000, mount="cpu")
    q = detect_quota(root, proc, affinity=set(range(6)))
    assert q.cgroup is None and q.cpus == 6


def test_no_cgroup_files_at_all(tmp_path):
    q = detect_quota(str(tmp_path / "none"), str(tmp_path / "none.txt"), affinity={0})
    assert q == CpuQuota(None, "", 1) and q.cpus == 1


def test_unreadable_cpu_max_is_ignored(tmp_path):
    root, proc = cgroup_v2(tmp_path, "/", {"": "garbage"})
    assert detect_quota(root, proc, affinity={0, 1, 2, 3}).cpus == 4


def test_resolve_order_flag_then_env_then_quota():
    quota = CpuQuota(2.0, "cpu.max", 8)
    assert resolve_threads(5, quota, env={"QUIRE_NUM_THREADS": "3"}) == (5, "--num-threads 5")
    assert resolve_threads(None, quota, env={"QUIRE_NUM_THREADS": "3"}) == (
        3, "QUIRE_NUM_THREADS=3")
    assert resolve_threads(None, quota, env={}) == (2, "--num-threads unset")


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_bad_env_value_names_the_variable(text):
    with pytest.raises(ValueError, match="QUIRE_NUM_THREADS must be an integer >= 1"):
        resolve_threads(None, CpuQuota(None, "", 4), env={"QUIRE_NUM_THREADS": text})


def test_server_leaves_a_cpu_to_the_event_loop_only_from_four():
    assert resolve_threads(None, CpuQuota(2.0, "cpu.max", 2), serving=True, env={})[0] == 2
    assert resolve_threads(None, CpuQuota(3.0, "cpu.max", 8), serving=True, env={})[0] == 3
    n, why = resolve_threads(None, CpuQuota(8.0, "cpu.max", 8), serving=True, env={})
    assert n == 7 and "event loop" in why
    assert resolve_threads(None, CpuQuota(8.0, "cpu.max", 8), env={})[0] == 8  # offline
    assert resolve_threads(8, CpuQuota(8.0, "cpu.max", 8), serving=True, env={})[0] == 8


def test_configure_sets_torch_and_logs(caplog, monkeypatch):
    monkeypatch.delenv("QUIRE_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="quire.cpu_threads"):
            n = configure_threads(None, quota=CpuQuota(1.0, "cpu.max", 2))
        assert n == 1 and torch.get_num_threads() == 1
        assert "threads: 1 (cgroup cpu.max 1, affinity 2 cpus, --num-threads unset)" \
            in caplog.text
        assert cpu_threads._interop_set  # tried once per process, whatever torch said
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cpus_warns(caplog, monkeypatch):
    monkeypatch.delenv("QUIRE_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="quire.cpu_threads"):
            assert configure_threads(3, quota=CpuQuota(1.5, "cpu.max", 8)) == 3
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "3 compute threads for 2 CPUs" in warned[0].getMessage()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="quire.cpu_threads"):
            configure_threads(2, quota=CpuQuota(1.5, "cpu.max", 8))
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def tiny_llama(tmp_path, smollm_tokenizer):
    """A tiny model's folder; torch's thread count, which engines set, is put back after."""
    before = torch.get_num_threads()
    yield save_tiny_model(str(tmp_path / "tiny"), tiny_config("llama"), smollm_tokenizer)
    torch.set_num_threads(before)


def test_engine_takes_num_threads_and_logs(tiny_llama, caplog):
    from quire import LLM
    with caplog.at_level(logging.INFO, logger="quire.cpu_threads"):
        llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=4 << 20, num_threads=1)
    assert llm.engine.num_threads == 1 and torch.get_num_threads() == 1
    assert "--num-threads 1" in caplog.text


@pytest.mark.parametrize("device,threads,budget", [
    ("cpu", 1, 512), ("cpu", 2, 512), ("cpu", 4, 1024), ("cpu", 6, 1536), ("cpu", 8, 2048),
    ("cpu", 64, 2048), ("cuda", 2, 2048)])
def test_step_budget_follows_the_compute_threads_on_a_cpu(device, threads, budget):
    from quire.platform import default_step_budget
    assert default_step_budget(torch.device(device), threads) == budget


def test_engine_resolves_the_step_budget_unless_given(tiny_llama, caplog):
    from quire import LLM
    with caplog.at_level(logging.INFO, logger="quire.engine.engine"):
        llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=4 << 20, num_threads=3)
    assert llm.engine.args.max_num_batched_tokens == 768
    assert llm.engine.scheduler.max_num_batched_tokens == 768
    assert "768 tokens per step" in caplog.text
    given = LLM(tiny_llama, dtype="float32", kv_cache_memory=4 << 20, num_threads=3,
                max_num_batched_tokens=96)
    assert given.engine.scheduler.max_num_batched_tokens == 96


def test_cli_has_the_flag():
    import argparse

    from quire.entrypoints.engine_args import add_engine_flags, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args_from(parser.parse_args(["--num-threads", "3"]), None).num_threads == 3
    with pytest.raises(ValueError, match="num_threads"):
        engine_args_from(parser.parse_args(["--num-threads", "0"]), None)
