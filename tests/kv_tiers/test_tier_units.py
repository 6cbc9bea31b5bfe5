"""The tiers' parts alone: the framed record's checks, the host tier's byte bound and LRU, the
chain's lookup order and promotion, the router's events index and topic rule."""

from __future__ import annotations

import pytest

from quire.kv_events.structs import BlockStored, KVEventBatch
from quire.kv_tiers.chain import TierChain
from quire.kv_tiers.framing import FrameError, frame, unframe
from quire.kv_tiers.host import HostTier
from quire.router.kv_event_index import KVEventIndex
from quire.router.kv_event_subscriber import KVEventSubscriber, backend_of_topic

FP, OTHER_FP = b"f" * 32, b"g" * 32
H = [bytes([i]) * 32 for i in range(8)]


def test_a_framed_record_is_read_back_only_by_its_reader():
    data = frame(FP, H[0], b"payload")
    assert unframe(data, FP, H[0]) == b"payload"
    for broken, why in [(frame(OTHER_FP, H[0], b"payload"), "fingerprint"),
                        (data, "hash"), (data[:-1], "truncated"),
                        (data[:-1] + b"X", "checksum"), (b"junk", "truncated"),
                        (b"X" * len(data), "not a Quire")]:
        with pytest.raises(FrameError, match=why):
            unframe(broken, FP, H[1] if why == "hash" else H[0])


def test_the_host_tier_stays_within_its_bytes_least_recently_used_first():
    evicted = []
    tier = HostTier(capacity_bytes=30)
    tier.on_evicted = lambda hashes, medium: evicted.extend(hashes)
    for h in H[:3]:
        assert tier.put(h, b"x" * 10)
    tier.get_many([H[0]])          # H[0] is now the most recently used
    tier.put(H[3], b"y" * 10)      # so H[1] goes
    assert evicted == [H[1]] and tier.used_bytes == 30
    assert tier.get_many([H[0], H[1], H[3]]) == [b"x" * 10, None, b"y" * 10]
    assert not tier.put(H[4], b"z" * 31)  # bigger than the tier: refused, nothing evicted
    assert tier.stats.evictions == 1


class _Slow(HostTier):
    name, medium, shared = "disk", "DISK", True


def test_the_chain_returns_the_leading_run_and_promotes_slow_hits():
    host, slow = HostTier(1000), _Slow(1000)
    chain = TierChain([host, slow])
    host.put(H[0], b"a")
    slow.put(H[1], b"b")
    slow.put(H[3], b"d")  # after a gap: useless
    assert chain.lookup(H[:4]) == [b"a", b"b"]
    assert host.contains(H[1])  # promoted
    assert host.stats.hits == 1 and slow.stats.hits == 1
    assert chain.lookup(H[:4], shared_ok=False) == [b"a", b"b"]  # now both from RAM
    assert host.stats.hits == 3 and slow.stats.hits == 1
    assert chain.lookup([H[3]], shared_ok=False) == []  # the slow tier is not asked
    chain.close()


def test_the_events_index_scores_the_leading_run_by_tier():
    index = KVEventIndex()
    index.stored("http://a", H[:4], "GPU")
    index.stored("http://b", H[:2], "GPU")
    index.stored("http://b", H[2:4], "CPU")
    index.stored("http://c", H[1:4], "GPU")  # no first block: no run
    scores = index.scores(H[:4], {"http://a", "http://b", "http://c"})
    assert scores == {"http://a": 4.0, "http://b": pytest.approx(3.6), "http://c": 0.0}
    index.removed("http://a", [H[1]], "GPU")
    assert index.scores(H[:4], {"http://a"}) == {"http://a": 1.0}
    index.stored("http://x", [H[1]], "REMOTE")  # shared: everyone's
    assert index.scores(H[:4], {"http://a"})["http://a"] == pytest.approx(1.0 + 0.3 + 2.0)
    index.forget("http://a")
    assert index.scores(H[:1], {"http://a"}) == {"http://a": 0.0}


def test_the_topic_names_the_backend_and_a_batch_updates_the_index():
    assert backend_of_topic("kv@10.0.0.7:8000@chat") == "http://10.0.0.7:8000"
    assert backend_of_topic("kv@10.0.0.7:8000@chat", "https") == "https://10.0.0.7:8000"
    assert backend_of_topic("other") is None
    import msgspec
    index = KVEventIndex()
    sub = KVEventSubscriber("tcp://127.0.0.1:1", index)
    batch = KVEventBatch(ts=1.0, events=[BlockStored(
        block_hashes=H[:2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
        lora_id=None, medium="GPU")])
    payload = msgspec.msgpack.encode(batch)
    sub.apply(b"kv@10.0.0.7:8000@chat", (0).to_bytes(8, "big"), payload)
    sub.apply(b"kv@10.0.0.7:8000@chat", (2).to_bytes(8, "big"), payload)  # 1 was lost
    assert sub.num_gaps == 1
    assert index.scores(H[:2], {"http://10.0.0.7:8000"}) == {"http://10.0.0.7:8000": 2.0}


def test_precise_prefix_picks_the_holder_unless_overloaded_else_least_load():
    from quire.router.backends import Backend
    from quire.router.policies import make_policy
    index = KVEventIndex()
    policy = make_policy("precise-prefix", events_index=index, load_factor=0.5, load_slack=0.0)
    a, b = Backend("http://a"), Backend("http://b")
    assert policy.pick([a, b], H[:3]).reason == "prefix_miss"
    index.stored("http://b", H[:3], "CPU")
    index.stored("http://a", H[:1], "GPU")
    choice = policy.pick([a, b], H[:3])
    assert (choice.backend, choice.reason) == (b, "prefix_hit")  # 2.4 beats 1.0
    b.in_flight = 10  # far above the mean: bounded load sends it elsewhere
    choice = policy.pick([a, b], H[:3])
    assert (choice.backend, choice.reason) == (a, "prefix_overloaded")
    policy.forget("http://b")
    b.in_flight = 0
    assert policy.pick([a, b], H[:3]).backend == a
