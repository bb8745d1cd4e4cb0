"""Shared test helpers: where the real MNIST is, and a bounded real ``mpirun``."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCAL_HOSTFILE = REPO / "hostfiles" / "local"


def mnist_dir() -> Path:
    """The real MNIST files the acceptance tests use (../shared/data/mnist by default)."""
    path = Path(os.environ.get("MPITRAIN_TEST_MNIST", REPO.parent / "shared" / "data" / "mnist"))
    if not (path / "train-images-idx3-ubyte.gz").is_file():
        pytest.fail(f"real MNIST not found at {path}; set MPITRAIN_TEST_MNIST to the folder "
                    "holding the IDX files")
    return path


@pytest.fixture
def mnist() -> Path:
    return mnist_dir()


def mpi_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("MPITRAIN_DATA_DIR", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_bounded(cmd, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the whole group and fail if it hangs."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or mpi_env(),
                            cwd=cwd or REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung for {timeout} s: {' '.join(map(str, cmd))}\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpirun_cmd(np_: int, *args, hostfile: Path = LOCAL_HOSTFILE, module="mpitrain",
               python=sys.executable) -> list:
    return ["mpirun", "-q", "-np", np_, "-hostfile", hostfile, python, "-m", module, *args]


def horovod_python() -> Path:
    """The interpreter of the Horovod environment setup.sh builds (TensorFlow 2.18 +
    Horovod 0.28.1; $MPITRAIN_HOROVOD_PYTHON overrides). Skips where the set-up was
    told not to build it; fails in CI otherwise, so a missing build step shows."""
    path = Path(os.environ.get("MPITRAIN_HOROVOD_PYTHON", REPO / ".venv-horovod/bin/python"))
    if path.is_file():
        return path
    message = f"no Horovod environment at {path} (bash setup.sh builds it)"
    if os.environ.get("CI") and not os.environ.get("MPITRAIN_NO_HOROVOD"):
        pytest.fail(message)
    pytest.skip(message)


def mpirun(np_: int, *args, timeout: float = 300, env=None, **kw) -> subprocess.CompletedProcess:
    """``mpirun -q -np N -hostfile hostfiles/local python -m mpitrain ARGS`` (bounded)."""
    return run_bounded(mpirun_cmd(np_, *args, **kw), timeout, env=env)


def read_rows(path: Path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="session")
def lr_accuracy(tmp_path_factory):
    """``lr_accuracy(np, *options)``: test accuracy of a default LR run on the real
    MNIST (30 epochs), run once per distinct (np, options) in the whole session:
    the sync and async accuracy tests compare against the same sync runs."""
    results = tmp_path_factory.mktemp("lr-accuracy")
    found = {}

    def accuracy(np_: int, *options) -> float:
        key = (np_, *options)
        if key not in found:
            result = mpirun(np_, "lr", "--data-dir", mnist_dir(), "--results-dir", results,
                            "--quiet", *options, timeout=600)
            assert result.returncode == 0, result.stderr[-2000:]
            found[key] = float(read_rows(results / "runs.csv")[-1]["test_accuracy"])
        return found[key]

    return accuracy
