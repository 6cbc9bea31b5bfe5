"""Prefix-cache block hashes: SHA-256 over the documented encoding, the same in the engine's
KV-cache manager and the router; and the extra keys (cache_salt, LoRA adapter, LongRoPE's long
table) keep blocks apart: same keys share, different keys never do."""

from __future__ import annotations

import hashlib
import struct

import pytest

from quire.engine.block_hash import (
    MAX_CACHE_SALT_CHARS,
    ExtraKeys,
    check_cache_salt,
    extend_block_hashes,
)
from quire.engine.block_pool import BlockPool
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request
from quire.router.prompt_hashing import PromptHasher, block_hashes, request_keys
from quire.sampling_params import SamplingParams

from engine_fakes import make_seq

BS = 4
DOMAIN = b"quire/kv-block-hash/v1\0"


def sha256_chain(tokens: list[int], block_size: int, keys_json: bytes) -> list[bytes]:
    """What the hashes must be, written from the spec with hashlib alone."""
    parent = hashlib.sha256(DOMAIN + keys_json).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}I", *block)).digest()
        out.append(parent)
    return out


def manager(caching: bool = True, num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), BS)


def admit(kv: KVCacheManager, seq) -> int:
    """The scheduler's admission of a waiting sequence; returns its prefix-hit tokens."""
    computed, num_computed = kv.get_computed_blocks(seq)
    kv.allocate_slots(seq, seq.num_tokens - num_computed, computed)
    seq.num_computed_tokens = seq.num_tokens
    return num_computed


class _Tokenizer:
    """Enough of a tokenizer for PromptHasher: a prompt of token ids needs none."""


@pytest.mark.parametrize("salt,keys_json", [(None, b"{}"),
                                            ("tenant-7", b'{"cache_salt":"tenant-7"}'),
                                            ("caf\u00e9", b'{"cache_salt":"caf\\u00e9"}')])
def test_engine_and_router_hashes_are_the_same_sha256_chain(salt, keys_json):
    tokens = [3, 70000, 12, 5, 1, 2, 3, 4, 9, 9, 9, 9, 42]  # 3 full blocks and a partial one
    want = sha256_chain(tokens, BS, keys_json)
    assert len(want) == 3 and all(len(h) == 32 for h in want)

    kv = manager()
    seq = Request("a", tokens, SamplingParams(max_tokens=4), frozenset(), 4)
    seq.cache_salt = salt
    kv.allocate_slots(seq, len(tokens))
    assert seq.block_hashes == want, "the engine's hashes are not the documented SHA-256"
    assert [kv.pool.blocks[i].block_hash for i in kv.block_ids(seq)[:3]] == want

    body = {"prompt": tokens} if salt is None else {"prompt": tokens, "cache_salt": salt}
    assert PromptHasher(_Tokenizer(), BS).hashes("/v1/completions", body) == want
    assert block_hashes(tokens, BS, request_keys(body)) == want


def test_the_extra_keys_encoding_is_canonical_and_refuses_other_types():
    assert ExtraKeys().encode() == b"{}"
    assert ExtraKeys(adapter=3, cache_salt="s", long_rope=True, client_request="r").encode() \
        == b'{"adapter":3,"cache_salt":"s","client_request":"r","long_rope":true}'
    assert ExtraKeys(adapter=3).encode() != ExtraKeys(adapter="3").encode()
    for bad in (1.5, object(), True, b"x", ("lora", 1)):
        with pytest.raises(TypeError, match="adapter"):
            ExtraKeys(adapter=bad).encode()


def test_every_extra_key_starts_another_chain():
    tokens = list(range(100, 116))
    chains = set()
    for keys in (ExtraKeys(), ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b"),
                 ExtraKeys(adapter=1), ExtraKeys(adapter=1, cache_salt="a"),
                 ExtraKeys(long_rope=True), ExtraKeys(long_rope=True, cache_salt="a"),
                 ExtraKeys(client_request="r1")):
        hashes: list[bytes] = []
        extend_block_hashes(hashes, tokens, BS, 4, keys)
        chains.add(tuple(hashes))
    assert len(chains) == 8


def test_a_block_is_hashed_once_when_it_fills_not_every_step():
    kv = manager()
    seq = make_seq("a", 5)
    kv.allocate_slots(seq, 5)
    seq.num_computed_tokens = 5
    first = list(seq.block_hashes)
    assert len(first) == 1
    for _ in range(2):  # decode steps inside the second block: nothing new to hash
        seq.append_token(7)
        kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        assert seq.block_hashes == first
    seq.append_token(7)
    kv.allocate_slots(seq, 1)  # the second block fills
    assert len(seq.block_hashes) == 2 and seq.block_hashes[0] is first[0]


def test_cache_salt_matrix_by_block_counts():
    """Same salt shares the prompt's full blocks; another salt, or salt vs none, shares none."""
    kv = manager()

    def seq(rid, salt):
        s = make_seq(rid, 9)  # two full blocks of 4, and one token
        s.cache_salt = salt
        return s

    alice1, alice2, bob, plain1, plain2 = (seq("a1", "alice"), seq("a2", "alice"),
                                           seq("b", "bob"), seq("p1", None), seq("p2", None))
    assert admit(kv, alice1) == 0
    assert admit(kv, alice2) == 8
    assert kv.block_ids(alice2)[:2] == kv.block_ids(alice1)[:2]
    assert admit(kv, bob) == 0
    assert admit(kv, plain1) == 0
    assert admit(kv, plain2) == 8
    tables = [kv.block_ids(s)[:2] for s in (alice1, bob, plain1)]
    assert len({b for t in tables for b in t}) == 6, "three salts, three sets of blocks"
    for s in (alice1, alice2, bob, plain1, plain2):
        kv.free(s)
    assert kv.num_used_blocks == 0 and kv.num_cached_free_blocks == 6


def test_salt_combines_with_the_long_rope_table_and_the_client_request():
    kv = manager()
    short, long_a, long_a2, long_b = (make_seq(r, 9) for r in ("s", "la", "la2", "lb"))
    for s, salt in ((short, "a"), (long_a, "a"), (long_a2, "a"), (long_b, "b")):
        s.cache_salt = salt
    for s in (long_a, long_a2, long_b):
        s.long_rope = True
    assert admit(kv, short) == 0
    assert admit(kv, long_a) == 0, "the long table's K/V are not the short table's"
    assert admit(kv, long_a2) == 8
    assert admit(kv, long_b) == 0, "same table, other salt"

    off = manager(caching=False)  # caching off: siblings of one client request still share
    first, sibling = (make_seq(r, 9, client_request_id="c") for r in ("c#0", "c#1"))
    other = make_seq("d", 9, client_request_id="d")
    for s in (first, sibling, other):
        s.cache_salt = "a"
    assert admit(off, first) == 0
    assert admit(off, sibling) == 8
    assert admit(off, other) == 0


@pytest.mark.parametrize("bad", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 5, b"salt"])
def test_a_bad_cache_salt_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        check_cache_salt(bad)
    check_cache_salt(None)
    check_cache_salt("x" * MAX_CACHE_SALT_CHARS)
