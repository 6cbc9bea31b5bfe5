"""Eviction, then the hit, for each tier: without tiers a prompt run again after the pool was
filled by others is recomputed (0 cached tokens); with a tier at least 90% of its full blocks
come back from the tier, and the output is the same tokens. Disk survives a restart; corrupt,
truncated and foreign files are misses; two engines share one real redis-server; a server
that goes away mid-run degrades to misses."""

from __future__ import annotations

import logging

import pytest
from tier_helpers import (
    BLOCK_SIZE,
    RedisServer,
    assert_no_blocks_in_use,
    evict_with,
    full_prompt_blocks,
    generate,
    prompt,
    tier_stats,
    tiny_llm,
)

from quire.kv_tiers.framing import frame, unframe

POOL_BLOCKS = 16
PROMPT = prompt(1, 200)                                  # 12 full blocks
FILLERS = [prompt(100 + i, 220) for i in range(3)]       # each needs 14+ of the 16 blocks


def _first_then_rerun(llm):
    first = generate(llm, [PROMPT])[0]
    evict_with(llm, FILLERS)
    again = generate(llm, [PROMPT])[0]
    if llm.engine.kv_tiers is not None:
        llm.engine.kv_tiers.flush()
    return first, again


def _assert_tier_hit(first, again):
    assert first.num_cached_tokens == 0
    need = 0.9 * full_prompt_blocks(PROMPT) * BLOCK_SIZE
    assert again.num_cached_tokens >= need, (again.num_cached_tokens, need)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_without_tiers_the_rerun_is_recomputed(tiny_models):
    path, config = tiny_models["llama"]
    llm = tiny_llm(path, config, POOL_BLOCKS)
    first, again = _first_then_rerun(llm)
    assert again.num_cached_tokens == 0  # the pool really forgot the prompt
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_blocks_in_use(llm)


def _tier_kwargs(tier, tmp_path, redis_url=None):
    if tier == "host":
        return {"kv_offloading_size": 0.01}
    if tier == "disk":
        return {"kv_offloading_disk_path": str(tmp_path / "kv"), "kv_offloading_disk_size": 0.01}
    return {"kv_offloading_remote": redis_url}


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_evicted_prefix_comes_back_from_the_tier(tier, tiny_models, tmp_path, request):
    redis_url = request.getfixturevalue("redis_server").url if tier == "remote" else None
    path, config = tiny_models["llama"]
    llm = tiny_llm(path, config, POOL_BLOCKS, **_tier_kwargs(tier, tmp_path, redis_url))
    try:
        first, again = _first_then_rerun(llm)
        _assert_tier_hit(first, again)
        stats = tier_stats(llm, tier)
        assert stats.hits >= 0.9 * full_prompt_blocks(PROMPT)
        assert stats.stores > 0 and stats.errors == 0
        assert_no_blocks_in_use(llm)
    finally:
        llm.engine.shutdown()


def test_tiers_stay_within_their_size(tiny_models, tmp_path):
    path, config = tiny_models["llama"]
    llm = tiny_llm(path, config, POOL_BLOCKS, kv_offloading_size=20 * 6144 / 2**30,
                   kv_offloading_disk_path=str(tmp_path / "kv"),
                   kv_offloading_disk_size=25 * 6400 / 2**30)
    try:
        for seed in range(6):
            generate(llm, [prompt(seed, 220)])
        llm.engine.kv_tiers.flush()
        host, disk = (tier_stats(llm, n) for n in ("host", "disk"))
        tiers = {t.name: t for t in llm.engine.kv_tiers.tiers}
        assert host.evictions > 0 and disk.evictions > 0
        assert tiers["host"].used_bytes <= tiers["host"].capacity_bytes
        assert tiers["disk"].used_bytes <= tiers["disk"].capacity_bytes
        files = list((tmp_path / "kv").rglob("*.kv"))
        assert len(files) == len(tiers["disk"]) and sum(f.stat().st_size for f in files) \
            <= tiers["disk"].capacity_bytes
    finally:
        llm.engine.shutdown()


def _disk_llm(tiny_models, tmp_path, family="llama"):
    path, config = tiny_models[family]
    return tiny_llm(path, config, POOL_BLOCKS, kv_offloading_disk_path=str(tmp_path / "kv"),
                    kv_offloading_disk_size=0.01)


def test_disk_tier_survives_a_restart(tiny_models, tmp_path):
    llm = _disk_llm(tiny_models, tmp_path)
    first = generate(llm, [PROMPT])[0]
    llm.engine.shutdown()  # waits for the writes
    restarted = _disk_llm(tiny_models, tmp_path)
    try:
        warm = generate(restarted, [PROMPT])[0]
        assert warm.num_cached_tokens >= 0.9 * full_prompt_blocks(PROMPT) * BLOCK_SIZE
        assert warm.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        restarted.engine.shutdown()
    # another model never reads them
    other = _disk_llm(tiny_models, tmp_path, family="qwen2")
    try:
        assert generate(other, [PROMPT])[0].num_cached_tokens == 0
    finally:
        other.engine.shutdown()


def test_corrupt_truncated_and_foreign_files_are_misses(tiny_models, tmp_path, caplog):
    llm = _disk_llm(tiny_models, tmp_path)
    first = generate(llm, [PROMPT])[0]
    seq_hashes = _prompt_hashes(llm)
    tier = next(t for t in llm.engine.kv_tiers.tiers if t.name == "disk")
    llm.engine.shutdown()
    # block 5 flipped, block 6 truncated, block 7 replaced by a record of another model
    p5, p6, p7 = (tier._path(seq_hashes[i]) for i in (5, 6, 7))
    data = bytearray(p5.read_bytes())
    data[-10] ^= 0xFF
    p5.write_bytes(bytes(data))
    p6.write_bytes(p6.read_bytes()[:-100])
    p7.write_bytes(frame(b"\x01" * 32, seq_hashes[7], b"\0" * 6144))
    caplog.set_level(logging.WARNING)
    restarted = _disk_llm(tiny_models, tmp_path)
    try:
        again = generate(restarted, [PROMPT])[0]
        assert again.num_cached_tokens == 5 * BLOCK_SIZE  # up to the first bad file
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert tier_stats(restarted, "disk").errors >= 1
        warnings = [r for r in caplog.records if "disk KV tier: ignoring" in r.getMessage()]
        assert len(warnings) == 1  # logged once
        # the bad files were removed, their blocks recomputed and stored again, sound
        restarted.engine.kv_tiers.flush()
        fingerprint = next(t for t in restarted.engine.kv_tiers.tiers).fingerprint
        for i, path in zip((5, 6, 7), (p5, p6, p7)):
            assert unframe(path.read_bytes(), fingerprint, seq_hashes[i])
        evict_with(restarted, FILLERS)
        restarted.engine.kv_tiers.flush()
        third = generate(restarted, [PROMPT])[0]
        assert third.num_cached_tokens >= 0.9 * full_prompt_blocks(PROMPT) * BLOCK_SIZE
        assert third.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        restarted.engine.shutdown()


def _prompt_hashes(llm):
    from quire.engine.block_hash import extend_block_hashes
    hashes = []
    extend_block_hashes(hashes, PROMPT, BLOCK_SIZE, full_prompt_blocks(PROMPT))
    return hashes


def test_two_engines_share_one_redis(tiny_models, redis_server):
    path, config = tiny_models["llama"]
    a = tiny_llm(path, config, POOL_BLOCKS, kv_offloading_remote=redis_server.url)
    b = tiny_llm(path, config, POOL_BLOCKS, kv_offloading_remote=redis_server.url)
    try:
        first = generate(a, [PROMPT])[0]
        a.engine.kv_tiers.flush()
        assert redis_server.client().dbsize() >= full_prompt_blocks(PROMPT)
        on_b = generate(b, [PROMPT])[0]  # never seen by b: a prefilled it
        assert on_b.num_cached_tokens >= 0.9 * full_prompt_blocks(PROMPT) * BLOCK_SIZE
        assert on_b.outputs[0].token_ids == first.outputs[0].token_ids
        # a tenant's salt keeps it apart in the shared tier too
        salted = generate(b, [PROMPT], cache_salt="tenant-b")[0]
        assert salted.num_cached_tokens == 0
        assert salted.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        a.engine.shutdown()
        b.engine.shutdown()


def test_remote_going_away_mid_run_degrades_to_misses(tiny_models, caplog):
    server = RedisServer().start()
    path, config = tiny_models["llama"]
    llm = tiny_llm(path, config, POOL_BLOCKS, kv_offloading_remote=server.url)
    try:
        first = generate(llm, [PROMPT])[0]
        llm.engine.kv_tiers.flush()
        server.stop()
        caplog.set_level(logging.WARNING)
        evict_with(llm, FILLERS)
        again = generate(llm, [PROMPT])[0]  # the server is gone: recomputed, not failed
        llm.engine.kv_tiers.flush()
        assert again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert not again.outputs[0].finish_reason == "error"
        assert tier_stats(llm, "remote").errors >= 1
        downs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(downs) == 1
        assert_no_blocks_in_use(llm)
    finally:
        llm.engine.shutdown()
        server.stop()
