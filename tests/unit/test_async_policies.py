"""The async server's pure policies for lost workers: liveness bounds and step quotas."""

import pytest

from mpitrain.async_trainer import Liveness, Quotas


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
