"""Preflight: each failure is one clear line and a non-zero exit within seconds.

Launch-side checks run without MPI; the in-job checks use real mpirun with MPMD
app contexts to give one rank a different environment (another mpitrain
version, no data), like a host with a stale checkout. Another Python on one
rank needs a second environment built with pip (network, minutes): that test
is in the slow tier.
"""

import shutil
import sys
import time

import pytest

from conftest import LOCAL_HOSTFILE, REPO, mnist_shard, mpi_env, run_bounded
from mpitrain import __version__


def mpitrain(*args, timeout=120, env=None):
    return run_bounded([sys.executable, "-m", "mpitrain", *map(str, args)], timeout, env=env)


def one_error_line(result):
    lines = [l for l in result.stderr.splitlines() if l.startswith("mpitrain: error")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("hostfile_text,args,pattern", [
    (None, ["-np", "2", "-hostfile", "/nonexistent/hostfile"], "hostfile /nonexistent/hostfile does not exist"),
    ("node0 slots=2\nnode1 cpus=3\n", ["-np", "3"], "hosts:2: cannot read 'cpus=3'"),
    ("node0 slots=x\n", ["-np", "1"], "hosts:1: slots must be a positive integer (got 'x')"),
    ("node0 slots=2\nnode1 slots=1\n", ["-np", "4"], "-np 4 needs 4 slots but the hostfile offers 3"),
    ("node0 slots=2\n", ["-np", "1", "lr", "--async"], "--async needs a parameter server"),
])
def test_launch_checks(tmp_path, hostfile_text, args, pattern):
    if hostfile_text is not None:
        (tmp_path / "hosts").write_text(hostfile_text)
        args = args[:2] + ["-hostfile", tmp_path / "hosts"] + args[2:]
    t0 = time.monotonic()
    result = mpitrain("check", *args, timeout=30)
    assert result.returncode == 2
    assert pattern in one_error_line(result)
    assert time.monotonic() - t0 < 15


def test_placement_of_the_cloudlab_shape():
    result = mpitrain("check", "-np", "4", "-hostfile", REPO / "hostfiles" / "cluster2",
                      "--no-launch", "lr", "--async")
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["rank 0: parameter server on node0",
                                          "rank 1: worker on node0", "rank 2: worker on node1",
                                          "rank 3: worker on node2"]


def test_check_job_passes(mnist):
    """(--async: the job's ranks check the run at the job's size; they took it for 1.)"""
    result = mpitrain("check", "-np", "4", "-hostfile", LOCAL_HOSTFILE, "lr", "--async",
                      "--data-dir", mnist, env=mpi_env())
    assert result.returncode == 0, result.stderr
    assert "preflight ok: 4 rank(s)" in result.stdout
    assert f"{mnist_shard(3)} per worker" in result.stdout


def mpmd(first_np, rest, second_env, module_args, timeout=180):
    """mpirun -np A python -m mpitrain ARGS : -np 1 -x VAR=... python -m mpitrain ARGS."""
    cmd = ["mpirun", "-q", "-hostfile", LOCAL_HOSTFILE, "-np", first_np, sys.executable, "-m",
           "mpitrain", *module_args, ":", "-np", "1"]
    for key, value in second_env.items():
        cmd += ["-x", f"{key}={value}"]
    cmd += [sys.executable, "-m", "mpitrain", *module_args]
    t0 = time.monotonic()
    result = run_bounded(cmd, timeout)
    return result, time.monotonic() - t0


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def other_environment(tmp_path_factory):
    """A second environment, as on a host set up differently: the system's Python
    (not the one this suite runs on) with mpi4py, numpy and mpitrain, no TensorFlow.
    `mpitrain check --in-job` runs in it (it never imports TensorFlow)."""
    if not shutil.which(SYSTEM_PYTHON):
        pytest.skip(f"no second Python at {SYSTEM_PYTHON} to build a different environment")
    venv = tmp_path_factory.mktemp("other-env") / "venv"
    made = run_bounded([SYSTEM_PYTHON, "-m", "venv", venv], 120)
    if made.returncode != 0:
        pytest.skip(f"cannot create a venv with {SYSTEM_PYTHON}: {made.stderr[-300:]}")
    pip = run_bounded([venv / "bin" / "python", "-m", "pip", "install", "-q", "mpi4py>=4,<5",
                       "numpy<2.1", "psutil", "--no-deps", str(REPO)], 600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    return venv / "bin" / "python"


def test_different_mpitrain_versions_are_named(mnist, tmp_path):
    """Offline: rank 3 runs a copy of mpitrain with another version (a host with a stale
    checkout; mpirun's -wdir puts the copy first on its path)."""
    stale = tmp_path / "stale"
    shutil.copytree(REPO / "mpitrain", stale / "mpitrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = stale / "mpitrain" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{__version__}"',
                                             '__version__ = "0.0.0+stale"'))
    assert "0.0.0+stale" in init.read_text()
    args = ["check", "--in-job", "lr", "--data-dir", str(mnist)]
    cmd = ["mpirun", "-q", "-hostfile", LOCAL_HOSTFILE, "-np", "3", sys.executable, "-m",
           "mpitrain", *args, ":", "-np", "1", "-wdir", stale, sys.executable, "-m", "mpitrain",
           *args]
    t0 = time.monotonic()
    result = run_bounded(cmd, 180)
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result)
    assert f"ranks run different versions: mpitrain {__version__} on" in line
    assert "mpitrain 0.0.0+stale on" in line
    assert "(rank 3)" in line and "(ranks 0,1,2)" in line
    assert "install the same environment on every host" in line
    assert time.monotonic() - t0 < 60


@pytest.mark.slow  # builds a second environment with pip: network and minutes
def test_different_versions_are_named(mnist, other_environment):
    same = run_bounded([sys.executable, "-c", "import platform; print(platform.python_version())"], 30)
    other = run_bounded([other_environment, "-c", "import platform; print(platform.python_version())"], 30)
    if same.stdout == other.stdout:
        pytest.skip("the system Python is the same version as this suite's")
    args = ["check", "--in-job", "lr", "--data-dir", str(mnist)]
    cmd = ["mpirun", "-q", "-hostfile", LOCAL_HOSTFILE, "-np", "3", sys.executable, "-m",
           "mpitrain", *args, ":", "-np", "1", other_environment, "-m", "mpitrain", *args]
    t0 = time.monotonic()
    result = run_bounded(cmd, 180)
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result)
    assert f"ranks run different versions: python {same.stdout.strip()} on" in line
    assert f"python {other.stdout.strip()} on" in line
    assert "(rank 3)" in line and "(ranks 0,1,2)" in line
    assert "install the same environment on every host" in line
    assert time.monotonic() - t0 < 60


def test_data_missing_on_one_host(tmp_path):
    result, seconds = mpmd(3, 1, {"MPITRAIN_DATA_DIR": tmp_path / "nodata"},
                           ["check", "--in-job", "lr", "--dataset", "mnist"])
    assert result.returncode == 1
    line = one_error_line(result)
    assert "rank 3 on" in line and "nodata: no such directory" in line


def test_a_host_that_cannot_be_reached_is_named_in_one_line(tmp_path):
    """mpirun's own answer is ssh's line and exit 255; the check probes every host first."""
    (tmp_path / "hosts").write_text("localhost slots=2\nno-such-host.invalid slots=2\n")
    t0 = time.monotonic()
    result = mpitrain("check", "-np", "4", "-hostfile", tmp_path / "hosts", "lr", timeout=120,
                      env=mpi_env())
    assert result.returncode == 1, result.stderr
    line = one_error_line(result)
    assert "host(s) no-such-host.invalid cannot be reached: mpirun cannot start a process " \
        "there (no-such-host.invalid: exit" in line and "fix the host name" in line
    assert [l for l in result.stderr.splitlines() if l.strip()] == [line]
    assert time.monotonic() - t0 < 60


def test_a_hydra_hostfile_is_read_as_well(tmp_path):
    (tmp_path / "hosts").write_text("# MPICH's format\nnode0:2\nnode1:1\nnode2\n")
    result = mpitrain("check", "-np", "4", "-hostfile", tmp_path / "hosts", "--no-launch",
                      "lr", "--async")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["rank 0: parameter server on node0",
                                          "rank 1: worker on node0", "rank 2: worker on node1",
                                          "rank 3: worker on node2"]
