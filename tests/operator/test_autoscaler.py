"""The autoscaler's decision function on its own: HPA arithmetic, windows, limits, missing data."""

from quire_operator.autoscaler import (
    KV_CACHE,
    QUEUE_DEPTH,
    PodSample,
    Policy,
    Recommendation,
    decide,
)

WAITING, KV = "quire:num_requests_waiting", "quire:kv_cache_usage_perc"


def policy(**overrides):
    base = dict(min_replicas=1, max_replicas=10, targets={QUEUE_DEPTH: 4.0, KV_CACHE: 0.8}, tolerance=0.1,
                scale_up_window=0, scale_down_window=300, max_scale_up_step=4)
    return Policy(**{**base, **overrides})


def pods(*queues, kv=0.1):
    return [PodSample(ready=True, metrics={WAITING: q, KV: kv}) for q in queues]


def test_scales_up_by_the_ratio_to_target():
    d = decide(2, pods(8, 8), policy(), [], now=1000)  # 8 waiting per replica, target 4: ratio 2
    assert (d.replicas, d.reason, d.signal, d.recommendation) == (4, "ScaledUp", QUEUE_DEPTH, 4)
    assert d.observed == {QUEUE_DEPTH: 8.0, KV_CACHE: 0.1}
    assert "queue depth 8 per replica" in d.message


def test_the_largest_ratio_wins():
    d = decide(2, pods(4, 4, kv=1.0), policy(), [], now=0)  # queue on target; KV 1.0/0.8 = 1.25
    assert (d.replicas, d.signal) == (3, KV_CACHE)


def test_no_change_inside_the_tolerance():
    d = decide(4, pods(4.3, 4.3, 4.3, 4.3), policy(), [], now=0)  # ratio 1.075
    assert (d.replicas, d.reason) == (4, "WithinTolerance")
    d = decide(4, pods(3.7, 3.7, 3.7, 3.7), policy(scale_down_window=0), [], now=0)  # ratio 0.925
    assert d.replicas == 4


def test_scale_down_waits_for_the_window_and_goes_to_the_highest_recommendation():
    p = policy(scale_down_window=60)
    history = [Recommendation(0, 6), Recommendation(30, 4)]
    d = decide(6, pods(0, 0, 0, 0, 0, 0), p, history, now=50)  # asks for 1, but 6 was recommended 50s ago
    assert (d.replicas, d.reason, d.recommendation) == (6, "ScaleDownStabilized", 1)
    d = decide(6, pods(0, 0, 0, 0, 0, 0), p, d.history, now=70)  # 6 has left the window; 4 has not
    assert (d.replicas, d.reason) == (4, "ScaledDown")
    d = decide(4, pods(0, 0, 0, 0), p, d.history, now=100)
    assert (d.replicas, d.reason) == (1, "ScaledDown")


def test_scale_up_window_takes_the_lowest_recommendation():
    p = policy(scale_up_window=30)
    d = decide(2, pods(8, 8), p, [Recommendation(0, 2)], now=10)  # a 2 in the window holds it
    assert (d.replicas, d.reason) == (2, "ScaleUpStabilized")
    d = decide(2, pods(8, 8), p, d.history, now=45)  # the window now holds only 4s
    assert d.replicas == 4


def test_scale_up_step_and_max_replicas_limit_the_jump():
    d = decide(1, pods(40), policy(max_scale_up_step=2), [], now=0)  # asks for 10
    assert (d.replicas, d.recommendation) == (3, 10)
    assert "limited by maxScaleUpStep" in d.message
    d = decide(1, pods(40), policy(max_replicas=2), [], now=0)
    assert d.replicas == 2 and "limited by maxReplicas" in d.message
    d = decide(2, pods(40, 40), policy(max_replicas=2), [], now=0)
    assert (d.replicas, d.reason) == (2, "AtMaxReplicas")


def test_replica_limits_are_enforced_without_metrics():
    assert decide(0, [], policy(min_replicas=2), [], now=0).replicas == 2
    assert decide(12, [], policy(max_replicas=5), [], now=0).replicas == 5


def test_no_data_no_decision():
    d = decide(3, [PodSample(ready=False), PodSample(ready=True, metrics=None)], policy(), [], now=0)
    assert (d.replicas, d.reason) == (3, "NoMetrics")
    assert d.history == ()  # nothing recommended


def test_missing_pods_count_as_idle_when_scaling_up():
    # 3 replicas wanted, one ready pod with 12 waiting: the two others count as 0, not as 12.
    d = decide(3, pods(12) + [PodSample(ready=False), PodSample(ready=True, metrics=None)], policy(), [], now=0)
    assert d.replicas == 3  # (12 + 0 + 0) / 3 = 4 per replica: on target
    d = decide(3, pods(24) + [PodSample(ready=False)], policy(), [], now=0)
    assert d.replicas == 6  # (24 + 0 + 0) / 3 = 8: ratio 2


def test_missing_pods_count_as_on_target_when_scaling_down():
    # One ready pod with an empty queue, two without metrics: they count as exactly on target.
    p = policy(scale_down_window=0, targets={QUEUE_DEPTH: 4.0})
    d = decide(3, pods(0) + [PodSample(ready=False), PodSample(ready=False)], p, [], now=0)
    assert d.replicas == 2  # (0 + 4 + 4) / 3 → ratio 0.667 → ceil(2.0)
    d = decide(10, pods(3.5) + [PodSample(ready=False)] * 9, p, [], now=0)
    assert (d.replicas, d.reason) == (10, "WithinTolerance")  # (3.5 + 36) / 40 = 0.99


def test_a_noisy_signal_does_not_flap():
    p = policy(scale_down_window=60, targets={QUEUE_DEPTH: 4.0})
    history, replicas, seen = None, 4, [4]
    for poll in range(40):  # every 15 s the total queue swings between 8 and 24 requests
        total = 24.0 if poll % 2 else 8.0
        d = decide(replicas, pods(*[total / replicas] * replicas), p, history, now=poll * 15)
        history, replicas = d.history, d.replicas
        seen.append(replicas)
    # Up once to cover the peaks, then steady: no down-and-up cycles.
    assert seen[:2] == [4, 4] and set(seen[2:]) == {6}


def test_history_is_pruned_and_unknown_history_holds_off_a_scale_down():
    p = policy(scale_down_window=60)
    d = decide(4, pods(0, 0, 0, 0), p, None, now=1000)  # after an operator restart
    assert (d.replicas, d.reason) == (4, "ScaleDownStabilized")
    old = [Recommendation(t, 9) for t in range(0, 100)]
    d = decide(4, pods(4, 4, 4, 4), p, old, now=1000)
    assert all(r.time >= 940 for r in d.history)


# --- unusable samples (issue 13, item 3): dropped, counted, never fatal ---

import math  # noqa: E402

import pytest  # noqa: E402


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -3.0])
@pytest.mark.parametrize("metric", [WAITING, KV])
def test_one_pod_with_an_unusable_sample_does_not_stop_the_decision(bad, metric):
    healthy = PodSample(ready=True, metrics={WAITING: 16.0, KV: 0.1}, name="chat-0")
    broken = PodSample(ready=True, metrics={WAITING: 16.0, KV: 0.1, metric: bad}, name="chat-1")
    d = decide(2, [healthy, broken], policy(), [], now=0)
    assert d.dropped == (f"chat-1 {metric}={bad}",)
    assert "ignored 1 unusable sample(s)" in d.message
    # The healthy signal still scales up: queue 16 per pod against 4 (the bad pod counts as
    # missing for the dropped signal, conservatively).
    assert d.reason == "ScaledUp" and d.replicas > 2
    assert all(math.isfinite(v) for v in d.observed.values())


def test_only_unusable_samples_means_no_decision_not_an_error():
    bad = [PodSample(ready=True, metrics={WAITING: math.nan, KV: math.inf}, name=f"chat-{i}") for i in range(2)]
    d = decide(2, bad, policy(), [], now=0)
    assert (d.replicas, d.reason) == (2, "NoMetrics")
    assert len(d.dropped) == 4


def test_metrics_the_autoscaler_does_not_use_are_not_judged():
    pod = PodSample(ready=True, metrics={WAITING: 4.0, KV: 0.5, "quire:num_preemptions_total": math.nan})
    assert decide(1, [pod], policy(), [], now=0).dropped == ()
