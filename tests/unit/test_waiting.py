"""How a rank waits (mpitrain.comm.waiting.poll and Backoff): short waits keep their
millisecond polling, a long wait slows its polling down in proportion to the time it
has waited, so it costs little CPU and answers at most a bounded fraction late. Pure:
a fake clock instead of MPI."""

import pytest

from mpitrain.comm import waiting
from mpitrain.comm.traffic import Traffic
from mpitrain.comm.waiting import HOT, IDLE, LONGEST_SLEEP, SERVING, Backoff, poll


def test_a_short_wait_polls_every_millisecond_at_most():
    assert IDLE.next_sleep(0.0008, waited=0.05) == IDLE.max_sleep == 1e-3
    assert IDLE.next_sleep(1e-4, waited=0.05) == 2e-4  # still doubling


def test_a_long_wait_sleeps_a_fraction_of_its_age_up_to_the_longest_sleep():
    b = Backoff(yield_for=0.0, patience=0.01)
    assert b.next_sleep(4e-3, waited=0.5) == pytest.approx(0.005)  # 1% of 0.5 s
    assert b.next_sleep(0.004, waited=1.0) == pytest.approx(0.008)  # doubles toward 0.01
    assert b.next_sleep(1e-2, waited=1000.0) == LONGEST_SLEEP


class FakeTime:
    """perf_counter and sleep of a clock that moves only when slept (and a little per
    test, as a real test costs microseconds)."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("backoff", [HOT, IDLE, SERVING], ids=["hot", "idle", "serving"])
def test_a_wait_of_ten_seconds_tests_a_few_hundred_times_and_answers_soon_after(
        monkeypatch, backoff):
    clock = FakeTime()
    monkeypatch.setattr(waiting.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(waiting.time, "sleep", clock.sleep)
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: setattr(clock, "now",
                                                                   clock.now + 1e-6))
    tests = []

    def done():
        tests.append(clock.now)
        clock.now += 1e-6
        return clock.now >= 10.0

    traffic = Traffic()
    assert poll(done, "control", backoff, 60.0, traffic)
    # polling every millisecond after the yield phase would have tested 10,000 times
    assert len([t for t in tests if t > backoff.yield_for]) < 1000
    assert clock.now - 10.0 <= LONGEST_SLEEP + 1e-3
    assert max(clock.sleeps) == LONGEST_SLEEP
    assert traffic.wait_seconds["control"] == pytest.approx(clock.now, abs=1e-3)


def test_a_wait_that_runs_out_returns_false_near_its_bound(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(waiting.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(waiting.time, "sleep", clock.sleep)
    assert not poll(lambda: False, "control", IDLE, 5.0, Traffic())
    assert 5.0 < clock.now <= 5.0 + LONGEST_SLEEP
