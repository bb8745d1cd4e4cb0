"""The one CPU placement rule of the CLI's runs and mpitrain.horovod scripts
(:func:`mpitrain.comm.placement.place`)."""

import os

import pytest

from mpitrain.comm import placement


@pytest.fixture
def cores(monkeypatch):
    """Four usable cores, and the affinity calls recorded instead of made."""
    widened = []
    monkeypatch.setattr(placement, "usable_cpus", lambda: 4)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: widened.append(list(cpus)),
                        raising=False)
    return widened


def test_training_ranks_on_a_host_share_its_cores(cores):
    assert placement.place(False, trainers_on_host=1) == 4
    assert placement.place(False, trainers_on_host=3) == 1
    assert placement.place(False, trainers_on_host=2) == 2
    assert placement.place(False, trainers_on_host=8) == 1  # at least one


def test_a_rank_that_does_not_train_gets_one_thread_and_given_threads_win(cores):
    assert placement.place(False, trainers_on_host=1, trains=False) == 1
    assert placement.place(False, trainers_on_host=3, threads=6) == 6
    assert placement.place(False, trainers_on_host=3, trains=False, threads=2) == 2


def test_the_affinity_is_widened_unless_the_binding_is_kept(cores):
    placement.place(True, trainers_on_host=1)
    assert cores == []
    placement.place(False, trainers_on_host=1)
    assert cores == [list(range(os.cpu_count() or 1))]
