"""The load the wait policy counts: cores other processes keep busy (mpitrain.comm.load)."""

import subprocess
import sys

import pytest

from mpitrain.comm import load


def fake_host(monkeypatch, busy_seconds):
    readings = iter(busy_seconds)
    monkeypatch.setattr(load, "_host_busy_seconds", lambda: next(readings))


def test_the_cores_others_kept_busy_over_the_window(monkeypatch):
    fake_host(monkeypatch, [100.0, 100.1])  # 0.1 CPU-second in a 0.1 s window
    assert 0.7 < load.others_busy_cores(0.1) <= 1.0


def test_a_trickle_below_noise_counts_as_nothing(monkeypatch):
    fake_host(monkeypatch, [100.0, 100.01])  # one tick of a daemon: 0.1 core
    assert load.others_busy_cores(0.1) == 0.0


def test_without_proc_stat_the_load_average_stands_in(monkeypatch):
    fake_host(monkeypatch, [None])
    monkeypatch.setattr(load.os, "getloadavg", lambda: (3.5, 0.0, 0.0))
    assert load.others_busy_cores(0.1) == 3.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_busy_process_beside_us_is_seen_on_the_real_host():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert load.others_busy_cores(0.3) >= 0.5
    finally:
        busy.kill()
        busy.wait()
