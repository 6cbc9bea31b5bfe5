"""Helpers for the KV-tier tests: a tiny model with a pool small enough that a few prompts
evict each other, a real redis-server on a free port, and the counts the tests assert."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time

import redis

from quire import LLM, SamplingParams

BLOCK_SIZE = 16
MAX_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)


def block_bytes(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * BLOCK_SIZE * config.num_key_value_heads * head_dim * 4


def tiny_llm(path: str, config, num_blocks: int, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=num_blocks * block_bytes(config), **kw)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def full_prompt_blocks(p: list[int]) -> int:
    """Blocks a prefix hit can cover: the last token is always computed."""
    return (len(p) - 1) // BLOCK_SIZE


def generate(llm: LLM, prompts, **kw):
    return llm.generate(prompts, GREEDY, use_tqdm=False, **kw)


def evict_with(llm: LLM, fillers: list[list[int]]) -> None:
    """Run prompts that need the whole pool, one at a time: every cached block is evicted."""
    for f in fillers:
        generate(llm, [f])


def tier_stats(llm: LLM, name: str):
    return llm.engine.kv_tiers.stats[name]


def assert_no_blocks_in_use(llm: LLM) -> None:
    pool = llm.engine.kv_manager.pool
    assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} KV blocks still in use"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server (Debian's package) on 127.0.0.1, no persistence, stopped by PID."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make install puts Debian's package in)"
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert self.proc.poll() is None, "redis-server exited at start"
                assert time.monotonic() < deadline, "redis-server did not answer in 20 s"
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@contextlib.contextmanager
def running_redis():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
