"""MPI_Finalize is a wait like any other: bounded, and without Open MPI's closing fence
under --enable-recovery. Each case runs in a fresh process (MPI initialises once per
process), as a singleton (no mpirun needed). Load beside them cannot change an outcome: each
bound is an alarm that ends a process sleeping far longer, or a finalize that takes
milliseconds."""

import signal
import subprocess
import sys
import textwrap

from conftest import REPO, mpi_env


def python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=mpi_env(**env))


STUCK = """
    import time
    from mpitrain.comm import runtime
    MPI = runtime._load_mpi()
    MPI.Finalize = lambda: time.sleep({seconds})  # a fence waiting for a rank that left
    {setup}
    started = time.monotonic()
    runtime.finalize()
    print("returned after", time.monotonic() - started)
"""


def test_a_finalize_that_never_returns_ends_the_process_at_its_bound():
    """The CLI bounds it (every rank of a training run ends together); so does a job
    under --enable-recovery."""
    for setup, env in [("runtime.bound_finalize(2)", {}),
                       ("runtime.FINALIZE_BOUND = 2", {"OMPI_MCA_orte_enable_recovery": "1"})]:
        done = python(STUCK.format(seconds=90, setup=setup), **env)
        assert done.returncode == -signal.SIGALRM, done.stdout + done.stderr
        assert "returned" not in done.stdout


def test_a_users_script_keeps_mpis_own_finalize():
    """Under mpitrain.fit, rank 0 may work on long after the other ranks wait in
    MPI_Finalize: no bound there outside --enable-recovery."""
    done = python(STUCK.format(seconds=3, setup=""))
    assert done.returncode == 0 and "returned after 3" in done.stdout, done.stderr


def test_a_normal_finalize_returns_and_cancels_its_bound():
    done = python("""
        import signal, time
        from mpitrain.comm import runtime
        runtime._load_mpi()
        runtime.finalize(bound=2)
        assert runtime.world_size_if_running() == 0
        assert signal.alarm(0) == 0, "the alarm outlived finalize"
        time.sleep(3)  # an alarm still armed would end the process here
        print("finalized")
    """)
    assert done.returncode == 0 and "finalized" in done.stdout, done.stderr


def test_recovery_jobs_finalize_without_the_fence():
    code = """
        import os
        from mpitrain.comm import runtime
        runtime._load_mpi()
        print(os.environ.get("OMPI_MCA_async_mpi_finalize"))
    """
    assert python(code, OMPI_MCA_orte_enable_recovery="1").stdout.split() == ["1"]
    assert python(code).stdout.split() == ["None"]
