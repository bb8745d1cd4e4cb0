"""The bounds around blocking MPI calls (mpitrain.comm.waiting): the bootstrap's
MPI_Comm_split and the allreduce's blocking wait. Past the bound the process ends
with one line that names the call and the fix; a call that returns in time leaves
nothing behind. Each case runs in a fresh process (the bound ends the whole
process), without MPI; and which ranks may spin."""

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_a_call_past_its_bound_ends_the_process_with_one_line():
    done = python("""
        import time
        from mpitrain.comm.waiting import blocking_call_bound
        print("before", flush=False)  # flushed by the watchdog before it leaves
        with blocking_call_bound(1, "a test call (MPI_Test_split)", "rank 3 on nodeA"):
            time.sleep(60)
        print("returned")
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.split() == ["before"]
    assert done.stderr.splitlines() == [
        "mpitrain: rank 3 on nodeA waited 1 s for a test call (MPI_Test_split); a rank did "
        "not arrive (raise --timeout if start-up is legitimately slower)"]


def test_a_call_that_returns_in_time_leaves_no_thread_running():
    done = python("""
        import threading, time
        from mpitrain.comm.waiting import blocking_call_bound
        before = threading.enumerate()
        with blocking_call_bound(1, "a quick call"):
            time.sleep(0.1)
        try:
            with blocking_call_bound(1, "a call that fails"):
                raise ValueError("failed")
        except ValueError:
            pass
        assert threading.enumerate() == before, threading.enumerate()
        time.sleep(1.5)  # past the bounds: a watchdog still armed would end the process
        print("still here")
    """)
    assert done.returncode == 0 and done.stdout.split() == ["still", "here"], done.stderr
    assert done.stderr == ""


# ---- the watchdog of the allreduce's blocking wait (SpinWatch) -----------------------
def test_a_spin_past_its_bound_ends_the_process_with_the_timeout_line():
    done = python("""
        import time
        from mpitrain.comm.waiting import SpinWatch
        watch = SpinWatch("rank 2 on nodeB")
        took = watch.run(time.sleep, 0.05, 5, "the gradient allreduce")  # returns in time
        print("took", 0.05 <= took < 2)
        watch.run(time.sleep, 60, 1, "the gradient allreduce")
        print("returned")
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.split() == ["took", "True"]
    assert done.stderr.splitlines() == [
        "mpitrain: error: rank 2 on nodeB waited 1 s for the gradient allreduce; that rank is "
        "stalled or dead (raise --timeout if this step is legitimately slower)"]


def test_a_spin_calls_while_waiting_about_every_second_and_never_after_it_returned():
    done = python("""
        import threading, time
        from mpitrain.comm.waiting import SpinWatch
        watch, beats, inside = SpinWatch("rank 1 on a"), [], threading.Event()

        def beat():  # the protocol's Python: never while the caller runs its own
            assert inside.is_set(), "while_waiting ran outside the call"
            beats.append(time.monotonic())

        def call(seconds):
            inside.set()
            time.sleep(seconds)
            inside.clear()

        watch.run(call, 2.5, 10, "the gradient allreduce", beat)
        during = len(beats)
        for _ in range(20):  # short calls back to back: no beat, never one in between
            watch.run(call, 0.05, 10, "the gradient allreduce", beat)
        time.sleep(1.5)
        print(during, len(beats))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2"]


def test_a_beat_given_late_is_not_followed_by_another_at_once():
    """A loaded host delays the watchdog (here: its lock held until 1.9 s into the call):
    the late beat comes, and the next one a whole WAITING_CALL_EVERY after it, not at
    the 2 s mark (beats 0.2 s apart, seen once in a full suite run)."""
    done = python("""
        import threading, time
        from mpitrain.comm.waiting import SpinWatch
        watch, beats = SpinWatch("rank 1 on a"), []

        def call(seconds):
            with watch._lock:  # the watchdog cannot look before 1.9 s
                time.sleep(1.9)
            time.sleep(seconds - 1.9)

        watch.run(call, 3.3, 10, "the gradient allreduce", lambda: beats.append(time.monotonic()))
        print(" ".join(f"{b - a:.2f}" for a, b in zip(beats, beats[1:])))
    """)
    assert done.returncode == 0, done.stderr
    gaps = [float(gap) for gap in done.stdout.split()]
    assert gaps and all(gap > 0.8 for gap in gaps), gaps


@pytest.mark.parametrize("wait,hosts,cpus,multiple,loads,spins", [
    ("auto", ["a", "a"], [2, 2], [True, True], None, True),  # -np 2 on 2 idle cores
    ("auto", ["a", "a", "a"], [2, 2, 2], [True] * 3, None, False),  # -np 3 on 2 cores
    ("auto", ["a", "a", "b", "b"], [2, 2, 2, 2], [True] * 4, None, True),
    ("auto", ["a", "b", "b", "b"], [4, 2, 2, 2], [True] * 4, None, False),  # one host short
    # the cores other processes keep busy: they need the cores too
    ("auto", ["a", "a"], [2, 2], [True, True], [0.4, 0.4], False),
    ("auto", ["a"] * 3, [8] * 3, [True] * 3, [1.5] * 3, True),  # 3 + 1.5 <= 8
    ("auto", ["a"] * 3, [8] * 3, [True] * 3, [12.0] * 3, False),  # a host busy with others
    ("auto", ["a", "b"], [4, 4], [True, True], [0.2, 3.5], False),  # one host busy: none
    ("spin", ["a"] * 4, [2] * 4, [True] * 4, [9.0] * 4, True),
    ("poll", ["a", "a"], [2, 2], [True, True], None, False),
    ("spin", ["a", "a"], [2, 2], [True, False], None, False),  # a rank without THREAD_MULTIPLE
])
def test_ranks_spin_only_where_every_rank_has_a_core_to_spare_and_all_agree(
        wait, hosts, cpus, multiple, loads, spins):
    from mpitrain.comm.communicator import spins as decide

    assert decide(wait, hosts, cpus, multiple, loads) is spins
