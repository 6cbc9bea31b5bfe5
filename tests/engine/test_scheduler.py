"""Scheduler: admission, chunked prefill, preemption by recompute and by swap, abort in every
state, n > 1 forks, beam groups as a unit, and the liveness guard. Fake model, no tensors."""

from __future__ import annotations

import pytest

from quire.engine.beam_search import BeamSearchParams, num_blocks_for_beam_search
from quire.engine.request import RequestStatus

from engine_fakes import FakeEngine, assert_blocks_owned_as_counted, assert_nothing_held


def test_fcfs_admission_and_chunked_prefill_share_one_budget():
    e = FakeEngine(num_blocks=16, max_num_batched_tokens=10)
    a, = e.add("a", prompt_len=4, max_tokens=3)
    b, = e.add("b", prompt_len=12, max_tokens=3, first_token=500)  # no prefix hit
    out = e.step()
    assert out.seq_ids == ["a", "b"] and out.num_new_tokens == [4, 6]
    out = e.step()  # a decodes first, b's prefill goes on in what is left
    assert list(zip(out.seq_ids, out.num_new_tokens)) == [("a", 1), ("b", 6)]
    e.run()
    assert e.finished["a"] == [e.finished["a"][0]] and len(e.finished["b"][0]) == 3
    assert_nothing_held(e)


def test_preemption_by_recompute_takes_the_youngest_and_brings_it_back():
    e = FakeEngine(num_blocks=4, block_size=4)
    old, = e.add("old", prompt_len=7, max_tokens=8)
    young, = e.add("young", prompt_len=7, max_tokens=8)
    preempted = []
    while e.scheduler.has_unfinished():
        preempted += e.step().preempted_ids
        assert_blocks_owned_as_counted(e)
    assert preempted and set(preempted) == {"young"}, preempted
    assert young.num_preemptions >= 1 and old.num_preemptions == 0
    assert e.scheduler.num_preemptions["recompute"] == len(preempted)
    reference = FakeEngine(num_blocks=64)
    reference.add("old", 7, 8)
    reference.add("young", 7, 8)
    reference.run()
    assert e.finished == reference.finished, "preemption changed what was generated"
    assert_nothing_held(e)


def test_preemption_by_swap_moves_blocks_to_the_host_and_back_before_waiting_ones():
    e = FakeEngine(num_blocks=4, block_size=4, swap_blocks=8)
    e.add("old", 7, 8)
    young, = e.add("young", 7, 8)
    swapped_out = swapped_in = 0
    while e.scheduler.has_unfinished():
        out = e.step()
        swapped_out += len(out.batch.swap_out)
        swapped_in += len(out.batch.swap_in)
        if young.status == RequestStatus.SWAPPED:
            assert e.kv_manager.block_ids(young) == [] and young.request_id in e.swapper.host_tables
        assert_blocks_owned_as_counted(e)
    assert e.scheduler.num_preemptions["swap"] > 0 and swapped_out == swapped_in > 0
    assert e.scheduler.num_preemptions["recompute"] == 0
    assert_nothing_held(e)


def test_swap_falls_back_to_recompute_when_the_host_is_full():
    e = FakeEngine(num_blocks=4, block_size=4, swap_blocks=1)
    e.add("old", 7, 8)
    e.add("young", 7, 8)
    e.run()
    assert e.scheduler.num_preemptions == {"recompute": e.scheduler.num_preemptions["recompute"],
                                           "swap": 0}
    assert e.scheduler.num_preemptions["recompute"] > 0
    assert_nothing_held(e)


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "swapped",
                                   "pending sibling", "beam group"])
def test_abort_in_every_state_gives_every_block_back(state):
    e = FakeEngine(num_blocks=4, block_size=4, swap_blocks=8, max_num_batched_tokens=4)
    e.add("old", 7, 8)
    if state == "beam group":
        e.add_beam("victim", 3, 4, width=2)
    else:
        e.add("victim", 7, 8, n=3 if state == "pending sibling" else 1)
    seqs = lambda: e.clients.get("victim") or list(e.beam_groups["victim"].live)  # noqa: E731
    wanted = {
        "waiting": lambda s: s.status == RequestStatus.WAITING,
        "prefilling": lambda s: s.status == RequestStatus.RUNNING and s.num_tokens_to_compute > 1,
        "decoding": lambda s: s.status == RequestStatus.RUNNING and s.num_output_tokens > 0,
        "swapped": lambda s: s.status == RequestStatus.SWAPPED,
        "pending sibling": lambda s: s.status == RequestStatus.RUNNING and s.pending_siblings,
        "beam group": lambda s: len(e.beam_groups["victim"].live) == 2,
    }[state]
    for _ in range(100):
        if wanted(seqs()[0]):
            break
        e.step()
    assert wanted(seqs()[0]), f"never reached state {state}"
    everything = seqs() + list(seqs()[0].pending_siblings)
    e.abort("victim")
    assert all(s.finished for s in everything)
    assert_blocks_owned_as_counted(e)
    e.run()
    assert_nothing_held(e)


def test_n_samples_fork_from_the_prompt_and_hold_it_once():
    e = FakeEngine(num_blocks=16, block_size=4)
    first, *siblings = e.add("r", prompt_len=8, max_tokens=4, n=3)
    out = e.step()
    assert out.forks == {"r#0": [s.request_id for s in siblings]} and out.seq_ids == ["r#0"]
    assert e.kv_manager.num_used_blocks == 2, "three samples hold the prompt's blocks once"
    assert all(e.kv_manager.block_ids(s) == e.kv_manager.block_ids(first) for s in siblings)
    e.step()  # each writes a new block: one of its own
    assert e.kv_manager.num_used_blocks == 2 + 3
    e.run()
    assert len(e.finished["r"]) == 3
    assert_nothing_held(e)


def test_beam_groups_are_scheduled_and_preempted_as_a_unit():
    e = FakeEngine(num_blocks=16, block_size=16)
    for i in range(3):
        e.add_beam(f"b{i}", 50, 20, width=4, first_token=100 * i)
    while e.scheduler.has_unfinished():
        units = [list(g.live) for g in e.beam_groups.values()
                 if all(b.num_tokens_to_compute == 1 for b in g.live)]  # about to decode
        out = e.step()
        for unit in units:
            ran = [b.request_id in out.seq_ids for b in unit]
            assert all(ran) or not any(ran), "a beam group's decodes were split"
            gone = [b.request_id in out.preempted_ids for b in unit]
            assert all(gone) or not any(gone), "a beam group was preempted in part"
        assert_blocks_owned_as_counted(e)
    assert e.scheduler.num_preemptions["recompute"] > 0, "no memory pressure: test is moot"


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "swap"])
def test_three_width_4_beam_searches_finish_in_16_blocks(swap_blocks):
    """The hang of issue 18: 16 blocks of 16 tokens, three 50-token prompts, width 4."""
    e = FakeEngine(num_blocks=16, block_size=16, swap_blocks=swap_blocks)
    big = FakeEngine(num_blocks=64, block_size=16)
    for engine in (e, big):
        for i in range(3):
            engine.add_beam(f"b{i}", 50, 20, width=4, first_token=100 * i)
        engine.run(max_steps=500)
    assert not e.failed and sorted(e.finished) == ["b0", "b1", "b2"]
    for rid, group in big.finished.items():
        assert [h.token_ids for h in e.finished[rid].done] == [h.token_ids for h in group.done]
    assert_nothing_held(e)


def test_width_2_beam_search_that_cannot_fit_5_blocks_is_refused_at_admission():
    """5 blocks of 16, a 50-token prompt, width 2, max_tokens 20: 50 + 20 <= 80, but the two
    beams' own tails (blocks 3-4 each) and the 3 shared blocks make 7."""
    params = BeamSearchParams(beam_width=2, max_tokens=20)
    assert num_blocks_for_beam_search(50, params, 16) == 7
    assert num_blocks_for_beam_search(50, BeamSearchParams(2, 14), 16) == 5


@pytest.mark.parametrize("swap_blocks", [0, 8], ids=["recompute", "swap"])
def test_width_2_beam_search_that_just_fits_5_blocks_finishes(swap_blocks):
    e = FakeEngine(num_blocks=5, block_size=16, swap_blocks=swap_blocks)
    e.add_beam("b", 50, 14, width=2)
    e.add("other", 30, 8)  # competes for the same blocks
    e.run(max_steps=300)
    assert not e.failed and set(e.finished) == {"b", "other"}
    assert_nothing_held(e)


def test_liveness_guard_fails_what_cannot_progress_instead_of_spinning():
    e = FakeEngine(num_blocks=2, block_size=4)
    seq, = e.add("a", prompt_len=3, max_tokens=4)
    e.scheduler.waiting.clear()  # a sequence that no queue will ever serve, holding blocks:
    e.scheduler.running.append(seq)  # what a scheduling bug would leave behind
    seq.status = RequestStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens  # nothing to compute, never sampled
    out = e.step()
    [(client_id, reason)] = out.failed
    assert client_id == "a" and seq.status == RequestStatus.FINISHED_ERROR
    assert "no sequence can make progress" in reason
    assert "2 KV blocks" in reason and not e.scheduler.has_unfinished()


def test_liveness_guard_fails_a_beam_group_that_cannot_grow_alone():
    """Admission normally refuses such a search; if one slips through it fails, not hangs."""
    e = FakeEngine(num_blocks=5, block_size=16)
    e.add_beam("b", 50, 14, width=2)
    group = e.beam_groups["b"]
    group.params.max_tokens = 20  # more than admission counted for
    for beam in group.live:
        beam.max_tokens = 20
    e.run(max_steps=300)
    assert "no sequence can make progress" in e.failed["b"] and group.error == e.failed["b"]
    assert_nothing_held(e)
