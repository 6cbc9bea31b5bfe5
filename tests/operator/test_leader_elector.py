"""The Lease rules on their own (issue 13, item 6): take it only when free, released or not
renewed for leaseDuration by our own clock; compare-and-swap on resourceVersion; give up after
renewDeadline without a renewal."""

import threading

import pytest

from quire_operator.kube import ApiError
from quire_operator.leader import LeaderElector, LeaseSettings


class FakeLeases:
    """Just enough of the API server for one Lease: get, create, patch with a resourceVersion check."""

    def __init__(self):
        self.lease, self.rv, self.down = None, 0, False

    def _check(self):
        if self.down:
            raise ApiError(503, "ServiceUnavailable", "the API server is down")

    def get(self, group, version, plural, namespace, name):
        self._check()
        return None if self.lease is None else {**self.lease, "spec": dict(self.lease["spec"])}

    def create(self, group, version, plural, namespace, body):
        self._check()
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", "exists")
        self.rv += 1
        self.lease = {"metadata": {"resourceVersion": str(self.rv)}, "spec": dict(body["spec"])}
        return self.lease

    def patch(self, group, version, plural, namespace, name, patch, subresource=None):
        self._check()
        if patch["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "modified")
        self.rv += 1
        self.lease = {"metadata": {"resourceVersion": str(self.rv)}, "spec": {**self.lease["spec"], **patch["spec"]}}
        return self.lease


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def elector(leases, clock, identity):
    return LeaderElector(leases, LeaseSettings("ns", "quire", identity, lease_duration=15, renew_deadline=10,
                                               retry_period=2), clock=clock)


def test_a_lease_held_and_renewed_is_not_taken():
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    for _ in range(10):  # a renews every few seconds: b never gets it
        clock.now += 5
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    assert leases.lease["spec"]["holderIdentity"] == "a"


def test_a_lease_not_renewed_for_its_duration_is_taken_by_the_candidates_own_clock():
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    assert a.try_acquire_or_renew()
    leases.lease["spec"]["renewTime"] = "2001-01-01T00:00:00.000000Z"  # a skewed clock's time: ignored
    assert not b.try_acquire_or_renew()  # b first sees this record now, and waits a full duration
    clock.now += 14
    assert not b.try_acquire_or_renew()
    clock.now += 2
    assert b.try_acquire_or_renew()
    spec = leases.lease["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert not a.try_acquire_or_renew()  # a, back, finds it held


def test_a_released_lease_is_taken_at_once():
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    a.release()
    assert leases.lease["spec"]["holderIdentity"] == ""
    assert b.try_acquire_or_renew()


def test_of_two_candidates_racing_for_a_free_lease_one_wins():
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    assert a.try_acquire_or_renew()
    a.release()
    stale = leases.get(None, None, None, None, None)
    assert b.try_acquire_or_renew()
    # a decides on the same record b just replaced: its write carries the old resourceVersion.
    leases.get = lambda *args: stale
    assert not a.try_acquire_or_renew()


def test_the_leader_gives_up_after_the_renew_deadline():
    leases, clock = FakeLeases(), Clock()
    a = elector(leases, clock, "a")
    assert a.try_acquire_or_renew()
    lost = []
    leases.down = True
    stop = threading.Event()
    stop.wait = lambda timeout: (setattr(clock, "now", clock.now + timeout), False)[1]  # time passes per retry
    a.keep(stop, lambda: lost.append(clock.now))
    assert lost == [10.0]  # five failed retries of 2 s


def test_timings_must_leave_room_for_a_renewal():
    with pytest.raises(ValueError):
        LeaseSettings("ns", "quire", "a", lease_duration=10, renew_deadline=10, retry_period=2)
