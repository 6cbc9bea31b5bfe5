"""KV-cache events in vLLM's wire format, decoded with this test's own msgspec definitions of
vLLM's structs (as vLLM's examples/online_serving/kv_events_subscriber.py has them): the
stored blocks' hashes, token ids and parent chaining, the evictions, the medium of each tier,
the 8-byte sequence numbers, and the replay socket."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from tier_helpers import evict_with, free_port, generate, prompt, tiny_llm

from quire.engine.block_hash import extend_block_hashes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
PROMPT = prompt(1, 70)  # 4 full blocks
TOPIC = "kv@replica-0"


def _receive(sub: zmq.Socket, until: float) -> list[tuple[int, KVEventBatch]]:
    got = []
    while time.monotonic() < until:
        if not sub.poll(100):
            if got:
                break
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


@pytest.fixture
def events_llm(tiny_models, tmp_path):
    port, replay = free_port(), free_port()
    path, config = tiny_models["llama"]
    llm = tiny_llm(path, config, 12, kv_offloading_size=0.01, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}", "topic": TOPIC})
    try:
        yield llm, port, replay
    finally:
        llm.engine.shutdown()


def test_events_name_the_blocks_their_chain_and_their_tier(events_llm):
    llm, port, replay_port = events_llm
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    try:
        time.sleep(0.5)  # PUB/SUB: a subscription takes a moment to reach the publisher
        generate(llm, [PROMPT])
        evict_with(llm, [prompt(50, 180)])  # needs all 12 blocks: the prompt's are evicted
        llm.engine.kv_tiers.flush()
        batches = _receive(sub, time.monotonic() + 10)
        seqs = [s for s, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
        events = [e for _, b in batches for e in b.events]
        hashes = []
        extend_block_hashes(hashes, PROMPT, 16, 4)
        stored = {}
        for e in events:
            if isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                    stored.setdefault(e.medium, {})[h] = (parent, e.token_ids[i * 16:(i + 1) * 16])
                assert e.block_size == 16 and e.lora_id is None
        for medium in ("GPU", "CPU"):  # the pool, then the host tier
            for i, h in enumerate(hashes):
                parent, tokens = stored[medium][h]
                assert tokens == PROMPT[i * 16:(i + 1) * 16]
                assert parent == (hashes[i - 1] if i else None)
        removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"
                   for h in e.block_hashes}
        assert set(hashes) <= removed  # the filler evicted them from the pool

        # the replay socket sends every kept batch from a sequence number on, then -1
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert [s for s, _ in replayed][:len(seqs)] == seqs
        assert replayed[0][1] == batches[0][1]
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
