"""Property tests: random add / step / abort / fork workloads (n > 1 forks at prompt end,
beam groups fork every round) on tiny caches. After every step each block is owned exactly as
its reference count says; at the end nothing leaks; and every request finishes or fails with
a clear error, never hangs. (Hypothesis settings: conftest.py.)"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from quire.engine.beam_search import BeamSearchParams, num_blocks_for_beam_search
from quire.engine.kv_cache_manager import KVCacheManager

from engine_fakes import FakeEngine, assert_blocks_owned_as_counted, assert_nothing_held, live_seqs

configs = st.fixed_dictionaries({
    "num_blocks": st.integers(2, 14),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "caching": st.booleans(),
    "swap_blocks": st.sampled_from([0, 0, 4, 16]),
    "max_num_seqs": st.integers(4, 12),
    "max_num_batched_tokens": st.integers(4, 48),
})
operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 10), st.integers(1, 3)),
    st.tuples(st.just("beam"), st.integers(1, 30), st.integers(1, 8), st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), max_size=25)


def fits(cfg: dict, op: tuple) -> bool:
    """What LLMEngine.add_request / add_beam_search accept (they reject the rest)."""
    kind, prompt_len, max_tokens, k = op
    if prompt_len + max_tokens > cfg["num_blocks"] * cfg["block_size"]:
        return False
    if kind == "add":
        return k <= cfg["max_num_seqs"]
    need = num_blocks_for_beam_search(prompt_len, BeamSearchParams(k, max_tokens),
                                      cfg["block_size"])
    return need <= cfg["num_blocks"] and k <= min(cfg["max_num_seqs"],
                                                  cfg["max_num_batched_tokens"])


def play(cfg: dict, ops: list[tuple]) -> FakeEngine:
    engine = FakeEngine(**cfg)
    ids: list[str] = []
    for i, op in enumerate(ops):
        if op[0] in ("add", "beam") and fits(cfg, op):
            rid = f"r{i}"
            if op[0] == "add":
                engine.add(rid, op[1], op[2], n=op[3], first_token=i)
            else:
                engine.add_beam(rid, op[1], op[2], width=op[3], first_token=i)
            ids.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                assert_blocks_owned_as_counted(engine)
        elif op[0] == "abort" and ids:
            engine.abort(ids[op[1] % len(ids)])
            assert_blocks_owned_as_counted(engine)
    engine.run(max_steps=engine.steps + 3000)  # audits after every step
    assert not live_seqs(engine)
    assert_nothing_held(engine)
    return engine


@given(configs, operations)
def test_random_workloads_keep_ref_counts_and_end(cfg, ops):
    play(cfg, ops)


@given(configs, operations.map(lambda ops: [op for op in ops if op[0] != "beam"]))
def test_workloads_that_fit_alone_never_fail(cfg, ops):
    """Without beam groups every request fits the cache alone, so the liveness guard must
    never fire: preemption always lets the oldest one go on."""
    engine = play(cfg, ops)
    assert not engine.failed, engine.failed


def test_the_property_finds_an_injected_leak(monkeypatch):
    """The audit can fail: with a free() that keeps each sequence's head block, the same
    property run reports the broken invariant by name."""
    def leaky_free(self, seq):
        blocks = self._tables.pop(seq.request_id, None)
        self._num_hashed.pop(seq.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1][:-1])  # the head block is never given back
    monkeypatch.setattr(KVCacheManager, "free", leaky_free)

    @settings(phases=[Phase.generate])  # found is enough: no need to shrink it
    @given(configs, operations)
    def leaky_run(cfg, ops):
        play(cfg, ops)
    with pytest.raises(AssertionError, match="block ownership invariant broken"):
        leaky_run()
