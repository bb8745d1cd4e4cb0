"""The bound around the bootstrap's one blocking MPI call (mpitrain.comm.waiting):
past it the process ends with one line that names the call and the fix; a call that
returns in time leaves nothing behind. Each case runs in a fresh process (the bound
ends the whole process), without MPI."""

import subprocess
import sys
import textwrap

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
