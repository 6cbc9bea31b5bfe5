"""The router's pure parts: block hashing, the prefix index, the policies, load parsing,
EndpointSlice reading."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from quire.engine import block_hash
from quire.engine.block_pool import BlockPool
from quire.engine.kv_cache_manager import KVCacheManager
from quire.router import migration, prompt_hashing
from quire.router.backends import Backend, BackendSet
from quire.router.discovery_k8s import ready_urls
from quire.router.load_scraper import parse_load
from quire.router.policies import LeastLoad, PrefixAware, RoundRobin, make_policy
from quire.router.prefix_index import PrefixIndex
from quire.router.prompt_hashing import block_hashes, request_keys


def test_block_hashes_are_the_engines_own():
    assert prompt_hashing.extend_block_hashes is block_hash.extend_block_hashes  # not copied
    tokens = list(range(1000, 1000 + 70))
    manager = KVCacheManager(BlockPool(8, enable_caching=True), block_size=16)
    request = SimpleNamespace(block_hashes=[], token_ids=tokens, cache_salt="t", lora=None,
                              long_rope=False, client_request_id="r", images=())
    manager._extend_hashes(request, len(tokens) // 16)
    assert block_hashes(tokens, 16, request_keys({"cache_salt": "t"})) == request.block_hashes
    assert len(block_hashes(tokens, 16)) == 4  # full blocks only
    assert block_hashes(tokens[:15], 16) == []
    # Chained: the same block after a different prefix hashes differently.
    assert block_hashes([1] * 16 + [2] * 16, 16)[1] != block_hashes([3] * 16 + [2] * 16, 16)[1]
    # Salted: another cache_salt, or none, or another model, is another chain.
    assert len({tuple(block_hashes(tokens, 16, request_keys(body))) for body in (
        {}, {"cache_salt": "t"}, {"cache_salt": "u"}, {"model": "sql"},
        {"model": "sql", "cache_salt": "t"})}) == 5


def test_prefix_index_longest_match_and_lru_bound():
    index = PrefixIndex(max_entries=5)
    index.record([1, 2, 3], "a")
    index.record([1, 2], "b")
    assert index.longest_match([1, 2, 3, 4], {"a", "b"}) == ({"a"}, 3)
    assert index.longest_match([1, 2, 9], {"a", "b"}) == ({"a", "b"}, 2)
    assert index.longest_match([1, 2, 3], {"b"}) == ({"b"}, 2)
    assert index.longest_match([7], {"a", "b"}) == (set(), 0)
    index.record([10, 11, 12], "c")  # 6 hashes > 5: the least recently used goes
    assert len(index) == 5
    index.forget("a")
    assert index.longest_match([1, 2, 3], {"a", "b", "c"})[0] <= {"b"}


def _backend(url: str, waiting: float = 0, running: float = 0, kv: float = 0) -> Backend:
    b = Backend(url)
    b.record_scrape(waiting, running, kv)
    return b


def test_least_load_counts_the_queue_the_kv_cache_and_our_own_in_flight_requests():
    a, b = _backend("http://a", waiting=3), _backend("http://b", waiting=1)
    policy = LeastLoad()
    assert policy.pick([a, b], []).backend is b
    b.in_flight = 5  # sent since the scrape: the scrape has not seen them
    assert policy.pick([a, b], []).backend is a
    full_kv = _backend("http://c", kv=1.0)
    empty = _backend("http://d", running=1)
    assert policy.pick([full_kv, empty], []).backend is empty


def test_prefix_aware_prefers_the_holder_until_it_is_overloaded():
    a, b, c = _backend("http://a"), _backend("http://b"), _backend("http://c")
    policy = PrefixAware(PrefixIndex(), load_factor=1.0, load_slack=2.0)
    first = policy.pick([a, b, c], [1, 2, 3])
    assert first.reason == "prefix_miss"
    policy.routed(first.backend, [1, 2, 3])
    again = policy.pick([a, b, c], [1, 2, 3, 4])
    assert (again.backend, again.reason) == (first.backend, "prefix_hit")
    first.backend.in_flight = 20  # far above (1 + 1) x mean + 2
    moved = policy.pick([a, b, c], [1, 2, 3, 4])
    assert moved.reason == "prefix_overloaded" and moved.backend is not first.backend


def test_round_robin_takes_turns_and_unknown_policies_are_refused():
    a, b = _backend("http://a"), _backend("http://b")
    policy = RoundRobin()
    assert [policy.pick([a, b], []).backend.url for _ in range(4)] == ["http://a", "http://b"] * 2
    with pytest.raises(ValueError, match="routing must be one of"):
        make_policy("random")


def test_load_parsing_reads_quire_names_and_falls_back_to_vllms():
    quire_text = ('quire:num_requests_waiting{model_name="m"} 3\n'
                  'quire:num_requests_running{model_name="m"} 2\n'
                  'quire:kv_cache_usage_perc{model_name="m"} 0.5\n'
                  'vllm:num_requests_waiting{model_name="m"} 99\n')
    assert parse_load(quire_text) == (3, 2, 0.5)
    vllm_text = ('vllm:num_requests_waiting{model_name="m"} 4\n'
                 'vllm:num_requests_running{model_name="m"} 1\n'
                 'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_load(vllm_text) == (4, 1, 0.25)


def test_endpoint_slices_yield_ready_non_terminating_endpoints_only():
    slices = {"s1": {"ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
                     "endpoints": [
                         {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                         {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                         {"addresses": ["10.0.0.3"], "conditions": {"ready": True,
                                                                    "terminating": True}},
                         {"addresses": ["10.0.0.4"]},  # no conditions: ready
                     ]},
              "s2": {"ports": [{"name": "http", "port": 8000}],
                     "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": True}}]}}
    assert ready_urls(slices, "http", None) == {"http://10.0.0.1:8000", "http://10.0.0.4:8000",
                                                "http://[fd00::5]:8000"}


def test_backend_set_keeps_the_figures_of_replicas_that_stay():
    backends = BackendSet(["127.0.0.1:1", "http://127.0.0.1:2/"])
    assert sorted(b.url for b in backends.all()) == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    backends.get("http://127.0.0.1:1").in_flight = 3
    forgotten = []
    backends.on_removed.append(forgotten.append)
    backends.replace(["http://127.0.0.1:1", "http://127.0.0.1:3"])
    assert backends.get("http://127.0.0.1:1").in_flight == 3
    assert forgotten == ["http://127.0.0.1:2"]


def test_prompt_hashes_are_salted_with_the_model_as_the_engine_salts_an_adapters_blocks():
    tokenizer = lambda text: SimpleNamespace(input_ids=[ord(c) for c in text])  # noqa: E731
    hasher = prompt_hashing.PromptHasher(tokenizer, 4)
    prompt = "sixteen letters."
    base = hasher.hashes("/v1/completions", {"model": "smollm2", "prompt": prompt})
    adapter = hasher.hashes("/v1/completions", {"model": "sql", "prompt": prompt})
    assert len(base) == len(adapter) == 4
    assert not set(base) & set(adapter)  # no block of one is a prefix hit for the other
    assert hasher.hashes("/v1/completions", {"model": "sql", "prompt": prompt}) == adapter
    assert hasher.hashes("/v1/completions", {"prompt": prompt}) == block_hashes([ord(c) for c in prompt], 4)


def test_a_clients_own_chat_template_is_never_run_by_the_router():
    """The replica runs a request's template in its sandbox (or refuses it); the router would
    run it unbounded before routing, so such a chat is routed without prefix hashes, and the
    template is never called."""
    calls = []

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            calls.append(kwargs)
            return [1, 2, 3, 4, 5, 6, 7, 8]

    hasher = prompt_hashing.PromptHasher(Tokenizer(), 4)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert len(hasher.hashes("/v1/chat/completions", chat)) == 2 and len(calls) == 1
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert hasher.hashes("/v1/chat/completions", {**chat, "chat_template": slow}) == []
    assert len(calls) == 1 and "chat_template" not in calls[0]


def test_a_continuations_usage_counts_only_the_clients_prompt_as_cached():
    """The continuation's replica was given prompt + continued tokens and may have found all
    of them cached; the client's usage is of its own prompt: cached_tokens <= prompt_tokens."""
    stream = migration.MigratingStream("/v1/completions", {"prompt": "x", "stream": True})

    def event(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    stream.feed(event({"id": "a", "choices": [{"index": 0, "text": "de", "token_ids": [4, 5],
                                               "prompt_token_ids": [1, 2, 3]}]}))
    stream.restart()
    out = stream.feed(event({"id": "b", "choices": [{
        "index": 0, "text": "f", "token_ids": [6], "prompt_token_ids": [1, 2, 3, 4, 5],
        "finish_reason": "length"}]}) + event({"id": "b", "choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 5}}}))
    usage = [json.loads(e[6:]) for e in out.split(b"\n\n") if e][-1]["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": 3}}
