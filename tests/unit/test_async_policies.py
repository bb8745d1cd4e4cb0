"""The async server's pure policies: staleness leases, liveness bounds, step quotas and
when it first looks for a push."""

from types import SimpleNamespace

import pytest

from mpitrain.config.bounds import Bounds
from mpitrain.config import Config
from mpitrain.train.leases import (MAX_FIRST_SLEEP, Leases, Liveness, Pipelining, Quotas,
                                   first_look)


def test_liveness_gives_the_whole_timeout_before_a_first_push():
    assert Liveness(timeout=300.0).bound(1) == 300.0


def test_liveness_is_a_multiple_of_the_step_interval_between_floor_and_timeout():
    live = Liveness(timeout=300.0, floor=10.0, factor=20.0)
    live.observe(1, 0.01)  # fast steps: the floor holds
    assert live.bound(1) == 10.0
    live.observe(2, 2.0)  # slow steps: 20x
    assert live.bound(2) == pytest.approx(40.0)
    live.observe(3, 60.0)  # very slow: never past the stall timeout
    assert live.bound(3) == 300.0


def test_liveness_follows_a_moving_average_of_the_intervals():
    live = Liveness(timeout=300.0, floor=0.0, factor=1.0)
    live.observe(1, 1.0)
    live.observe(1, 2.0)
    assert live.bound(1) == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)


def test_quotas_move_a_lost_workers_remaining_steps_to_the_active_ones():
    quotas = Quotas([1, 2, 3], total_steps=100)
    gained = quotas.reassign(2, steps_done=41, active=[1, 3])
    assert gained == {1: 30, 3: 29}  # 59 left: the remainder to the lowest rank
    assert quotas.of == {1: 130, 2: 41, 3: 129}
    assert sum(quotas.of.values()) == 300  # the planned updates are kept
    assert quotas.short == 0


def test_quotas_count_steps_nobody_can_take_as_short():
    quotas = Quotas([1, 2], total_steps=50)
    assert quotas.reassign(1, steps_done=20, active=[]) == {}
    assert quotas.short == 30
    assert quotas.of[1] == 20


def test_a_lost_worker_is_never_among_its_own_takers():
    quotas = Quotas([1, 2], total_steps=10)
    assert quotas.reassign(1, steps_done=4, active=[1, 2]) == {2: 6}
    assert quotas.of == {1: 4, 2: 16}


def test_quotas_share_steps_as_evenly_as_they_go():
    quotas = Quotas([1, 2, 3], total_steps=10)
    assert quotas.share(7, [3, 1]) == {1: 4, 3: 3}  # the remainder to the lowest rank
    assert quotas.of == {1: 14, 2: 10, 3: 13} and quotas.short == 0
    assert quotas.share(5, []) == {} and quotas.short == 5


def test_parked_workers_hear_from_the_server_every_half_timeout(monkeypatch):
    """A parked worker waits twice --timeout for the server's word: the server speaks
    every half --timeout (a PARKED reply), until it unparks or releases the worker."""
    from mpitrain.train.asynchronous import recovery

    now = [100.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: now[0])
    ctx = SimpleNamespace(comm=SimpleNamespace(timeout=10.0, bounds=Bounds(10.0)),
                          cfg=Config.of(liveness_floor=1.0))
    parking = recovery.Recovery(ctx, clock=lambda: 0.0, n_workers=2)
    parking.park(1)
    now[0] += 4.0
    parking.park(2)
    assert parking.keepalives() == []
    now[0] += 1.0  # half the timeout since rank 1 parked
    assert parking.keepalives() == [1] and parking.keepalives() == []
    now[0] += 4.0
    assert parking.keepalives() == [2]
    assert parking.unpark(1) and not parking.unpark(1)
    assert parking.release() == [2] and parking.parked == {}


def test_leases_without_a_bound_are_granted_to_everyone_waiting():
    leases = Leases(None, [1, 2, 3])
    granted = []
    for rank in leases.next_waiting(version=0):
        leases.grant(rank, 0)
        granted.append(rank)
    assert granted == [1, 2, 3] and leases.holders == [1, 2, 3]


def test_a_zero_bound_lets_one_worker_compute_at_a_time():
    leases = Leases(0, [1, 2])
    for rank in leases.next_waiting(version=0):
        leases.grant(rank, 0)
    assert leases.holders == [1]  # 2 waits: its gradient would be one update stale
    assert leases.returned(1) == 0
    leases.wait(1)
    for rank in leases.next_waiting(version=1):  # 1's gradient applied: version 1
        leases.grant(rank, 1)
    assert leases.holders == [2]  # first come, first served
    assert list(leases.waiting) == [1]


def test_a_bound_holds_fast_workers_back_until_the_slow_one_has_pushed():
    # K = 2, three workers: with v the version and base[u] each holder's lease,
    # a grant keeps (v - base[u]) + |holders| - 1 <= 2 for every holder
    leases = Leases(2, [1, 2, 3])
    for rank in leases.next_waiting(version=0):
        leases.grant(rank, 0)
    assert leases.holders == [1, 2, 3]
    leases.returned(1)  # version 1
    leases.wait(1)
    # slow 3 (base 0) would see (1 - 0) + 3 - 1 = 3 > 2 with 1 holding a lease again
    assert list(leases.next_waiting(version=1)) == []
    leases.returned(2)  # version 2: holders {3}: (2 - 0) + 2 - 1 = 3 > 2, still held
    leases.wait(2)
    assert list(leases.next_waiting(version=2)) == []
    leases.returned(3)  # version 3: nobody holds one: a grant is always possible
    leases.wait(3)
    granted = []
    for rank in leases.next_waiting(version=3):
        leases.grant(rank, 3)
        granted.append(rank)
    assert granted == [1, 2, 3]  # all at version 3: (3 - 3) + 3 - 1 = 2 <= 2


def test_a_dropped_worker_no_longer_holds_the_others_back():
    leases = Leases(0, [1, 2])
    for rank in leases.next_waiting(version=0):
        leases.grant(rank, 0)
    leases.drop(1)  # lost while holding the only lease
    assert list(leases.next_waiting(version=0)) == [2]
    leases.wait(1)
    leases.drop(1)  # a dropped worker is not served either
    assert not leases.waiting


def test_liveness_names_why_a_worker_is_lost():
    live = Liveness(timeout=300.0, floor=10.0, factor=20.0)
    live.observe(1, 0.01)
    assert live.lost_because(1, silent_for=5.0, alive=True) == ""
    assert "past its liveness bound of 10.0 s" in live.lost_because(1, 11.0, alive=True)
    assert live.lost_because(1, 0.5, alive=False).startswith("its process died")


def test_first_look_is_two_steps_after_the_oldest_lease():
    # lease granted at t=10.0, steps of 1 ms, now 10.0005: look at 10.002
    assert first_look(10.0, 1e-3, 10.0005) == pytest.approx(1.5e-3)


def test_first_look_is_now_when_the_push_is_already_due():
    assert first_look(10.0, 1e-3, 10.003) <= 0.0


def test_first_look_never_sleeps_longer_than_its_cap():
    # slow steps (a large model): a stop request must still be noticed soon
    assert first_look(10.0, 5.0, 10.0) == MAX_FIRST_SLEEP


def steps(pipelining, ratios, compute=0.005):
    """Feed ``pipelining`` one window of steps per ratio (wait / compute), after the
    first step; returns the depth after each window."""
    pipelining.observe(10.0, 10.0)  # the first step (tracing): not counted
    depths = []
    for ratio in ratios:
        for _ in range(Pipelining.WINDOW):
            depth = pipelining.observe(compute, ratio * compute)
        depths.append(depth)
    return depths


def test_pipelining_on_and_off_never_change():
    assert steps(Pipelining("on"), [0.0] * 4) == [2] * 4
    assert steps(Pipelining("off"), [5.0] * 4) == [1] * 4


def test_auto_pipelines_once_the_median_window_waits_a_third_of_a_step():
    # LR-like: judged at the third window, then pipelined for good
    assert steps(Pipelining("auto"), [0.2, 0.9, 0.6, 0.1, 0.1]) == [1, 1, 2, 2, 2]


def test_auto_does_not_pipeline_for_an_odd_slow_window():
    # LeNet-like: waits of a fifth of a step, one window slowed by a neighbour
    pipelining = Pipelining("auto")
    assert steps(pipelining, [0.16, 0.43, 0.12, 0.2] + [0.15] * 12) == [1] * 16
    assert not pipelining.measuring  # decided for the run: one push in flight
    assert steps(pipelining, [5.0])[-1] == 1
