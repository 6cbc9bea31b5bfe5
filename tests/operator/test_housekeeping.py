"""The housekeeping loop's schedule on its own: polls at each object's interval, resyncs every
period, one job per object at a time, a deleted object forgotten (issue 13, items 2 and 5)."""

from quire_operator.housekeeping import Housekeeping, Polled


class Inline:
    """A loop stand-in whose executor runs each job at once, or holds it (to test 'busy')."""

    def __init__(self, hold=False):
        self.hold, self.held = hold, []

    def run_in_executor(self, executor, fn, *args):
        if self.hold:
            self.held.append((fn, args))
        else:
            fn(*args)


def keeper(calls, resync_seconds=300.0):
    def poll(key, entry, history):
        calls.append(("poll", key, history))
        return (history or 0) + 1

    return Housekeeping(poll=poll, resync=lambda key: calls.append(("resync", key)),
                        resync_seconds=resync_seconds)


A, B = ("default", "a"), ("default", "b")


def test_each_object_polls_at_its_own_interval_and_keeps_its_history():
    calls = []
    k = keeper(calls)
    loop = Inline()
    entries = [(A, {"poll_seconds": 1}), (B, {"poll_seconds": 5})]
    for now in (0, 0.5, 1.0, 2.0, 5.0):
        k.start_due_jobs(loop, entries, now)
    assert [c for c in calls if c[1] == A] == [("poll", A, None), ("poll", A, 1), ("poll", A, 2), ("poll", A, 3)]
    assert [c for c in calls if c[1] == B] == [("poll", B, None), ("poll", B, 1)]


def test_resync_comes_every_period_with_or_without_autoscaling():
    calls = []
    k = keeper(calls, resync_seconds=10)
    loop = Inline()
    for now in (0, 5, 10, 15, 20):
        k.start_due_jobs(loop, [(A, {"poll_seconds": None})], now)
    assert calls == [("resync", A), ("resync", A)]  # at 10 and 20: one period after first seen
    calls.clear()
    for now in (0, 1, 2, 3):  # polled every tick, and resynced all the same
        k.start_due_jobs(loop, [(B, {"poll_seconds": 1})], now)
    assert calls[:2] == [("poll", B, None), ("poll", B, 1)]
    k.start_due_jobs(loop, [(B, {"poll_seconds": 1})], 10)
    assert calls[-2:] == [("resync", B), ("poll", B, 4)]


def test_one_job_at_a_time_per_object():
    calls = []
    k = keeper(calls)
    loop = Inline(hold=True)
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 0)
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 5)  # the first poll is still running
    assert len(loop.held) == 1
    fn, args = loop.held.pop()
    fn(*args)
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 6)
    assert len(loop.held) == 1


def test_a_failing_job_is_logged_not_fatal():
    k = Housekeeping(poll=lambda key, entry, history: 1 / 0, resync=lambda key: None, resync_seconds=300)
    loop = Inline()
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 0)
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 1)  # tried again: not stuck as busy


def test_a_deleted_object_is_forgotten():
    calls = []
    k = keeper(calls)
    loop = Inline()
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 0)
    k.start_due_jobs(loop, [], 1)
    k.start_due_jobs(loop, [(A, {"poll_seconds": 1})], 2)  # recreated: a fresh history
    assert calls == [("poll", A, None), ("poll", A, None)]


def test_a_poll_may_ask_to_be_polled_sooner():
    """Scale to zero: while no replica runs, a held request should not wait a whole interval."""
    calls = []

    def poll(key, entry, history):
        calls.append(history)
        return Polled((history or 0) + 1, next_poll_seconds=2 if (history or 0) < 2 else None)

    k = Housekeeping(poll=poll, resync=lambda key: None, resync_seconds=300)
    loop = Inline()
    for now in range(0, 31):
        k.start_due_jobs(loop, [(A, {"poll_seconds": 15})], now)
    # at 0 and 2 (asked for 2 s), then at 4 it asks for nothing: the interval again (19, 34...)
    assert calls == [None, 1, 2, 3]


def test_adapter_syncs_run_at_their_interval_and_at_once_when_the_trigger_changes():
    calls = []

    def sync(key, entry, history):
        calls.append((key, history))
        return (history or 0) + 1

    k = Housekeeping(poll=lambda key, entry, history: None, resync=lambda key: None, resync_seconds=300,
                     sync_adapters=sync)
    loop = Inline()
    two_pods = {"adapter_seconds": 10, "adapter_trigger": ("sql", "pod-0", "pod-1"), "poll_seconds": None}
    for now in (0, 1, 5):
        k.start_due_jobs(loop, [(A, two_pods), (B, {"poll_seconds": None, "adapter_seconds": None})], now)
    assert calls == [(A, None)]  # at once, then not before the interval; B has no adapters
    k.start_due_jobs(loop, [(A, {**two_pods, "adapter_trigger": ("sql", "pod-0", "pod-1", "pod-2")})], 6)
    assert calls[-1] == (A, 1)  # a replica turned ready: synced at the next tick
    k.start_due_jobs(loop, [(A, {**two_pods, "adapter_trigger": ("sql", "pod-0", "pod-1", "pod-2")})], 15)
    assert len(calls) == 2
    k.start_due_jobs(loop, [(A, {**two_pods, "adapter_trigger": ("sql", "pod-0", "pod-1", "pod-2")})], 16)
    assert calls[-1] == (A, 2)  # the interval after the last sync


def test_a_slow_adapter_sync_does_not_hold_up_the_autoscaler():
    calls = []
    k = Housekeeping(poll=lambda key, entry, history: calls.append("poll"), resync=lambda key: None,
                     resync_seconds=300, sync_adapters=lambda key, entry, history: calls.append("sync"))
    loop = Inline(hold=True)
    entry = {"poll_seconds": 1, "adapter_seconds": 10, "adapter_trigger": "x"}
    k.start_due_jobs(loop, [(A, entry)], 0)
    sync_fn, sync_args = loop.held.pop(0)  # the adapter sync, still running
    poll_fn, poll_args = loop.held.pop()
    poll_fn(*poll_args)  # the first poll ends
    k.start_due_jobs(loop, [(A, {**entry, "adapter_trigger": "y"})], 1)
    assert len(loop.held) == 1  # the next poll starts; the second sync waits for the first to end
    sync_fn(*sync_args)
    k.start_due_jobs(loop, [(A, {**entry, "adapter_trigger": "y"})], 1.5)
    assert len(loop.held) == 2
