"""How a node's worker processes start: from a fork server.

A spawned worker is a fresh interpreter that imports torch and Quire before it can join
(~3 s of a core on a 2-core EPYC, every rank, every engine). The fork server is started once
per process, clean (spawned, not forked: no CUDA context, no OpenMP pool, no threads of the
engine), imports torch and the worker's module, and forks each worker from that state: the
second engine of a process (a restart, a test suite, a notebook) starts its ranks in a fraction
of a second, and no worker inherits anything the engine process initialized.

What a fork server would otherwise get wrong: the environment. Its children inherit the
server's, taken when it started; a worker gets the engine process's environment of the moment
it is started instead (as a spawned one would), before it reads any setting.
"""

from __future__ import annotations

import os

import torch

# What the fork server imports once: the worker, what it imports when it starts, and what
# unpickling its spec's transformers config imports (~2 s: any family's configuration module
# pulls in the shared part, torch.distributed.tensor and sympy among it). The fork server skips
# a module that fails to import.
PRELOADED = ["quire.distributed.worker_main", "quire.distributed.pipeline",
             "quire.worker.model_builder", "quire.worker.model_runner",
             "transformers.models.llama.configuration_llama"]


def worker_context():
    """The multiprocessing context a node's ranks start from."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def start_worker(ctx, target, args: tuple, name: str):
    """A started daemon Process running target(*args) in this process's current environment."""
    proc = ctx.Process(target=_in_environment, args=(dict(os.environ), target, args),
                       daemon=True, name=name)
    proc.start()
    return proc


def _in_environment(environment: dict, target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    target(*args)
