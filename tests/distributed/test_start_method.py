"""Workers start from a fork server (quire/distributed/start_method.py), in the environment
the engine process has when it starts them, not the one the server was started with."""

from __future__ import annotations

import os

from quire.distributed.start_method import start_worker, worker_context


def test_a_worker_gets_the_environment_of_the_moment_it_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("QUIRE_TEST_SETTING", raising=False)
    ctx = worker_context()
    # the setting, and the parent of the worker ($PPID: os.system's shell is its child)
    shell = "echo \"[$QUIRE_TEST_SETTING]\" > {} && awk '/^PPid/ {{print $2}}' /proc/$PPID/status > {}"
    before = start_worker(ctx, os.system, (shell.format(tmp_path / "a", tmp_path / "pa"),),
                          "before")  # (starts the fork server if no engine has yet)
    before.join(60)
    monkeypatch.setenv("QUIRE_TEST_SETTING", "set later")
    after = start_worker(ctx, os.system, (shell.format(tmp_path / "b", tmp_path / "pb"),),
                         "after")
    after.join(60)
    assert before.exitcode == after.exitcode == 0
    assert (tmp_path / "a").read_text() == "[]\n"
    assert (tmp_path / "b").read_text() == "[set later]\n"
    # both forked by one server, a child of this process, not by this process itself
    parents = {int((tmp_path / p).read_text()) for p in ("pa", "pb")}
    [server] = parents
    assert server != os.getpid()
    with open(f"/proc/{server}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
