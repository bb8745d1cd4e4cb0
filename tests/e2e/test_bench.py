"""Smoke test of the benchmark suite: the --quick mode runs end to end and writes
its CSVs, figures and summary. It checks that the suite runs, not its targets
(those are measured on a quiet machine: docs/benchmarks.md)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, mnist_dir, mpi_env

pytestmark = pytest.mark.slow


def bench(*args, timeout=600):
    # the benchmarks read MNIST from MPITRAIN_DATA_DIR: the same copy the tests use
    result = subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO,
                            env=mpi_env(MPITRAIN_DATA_DIR=str(mnist_dir())),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = Path(result.stdout.split("summary: ")[-1].split()[0])
    return summary.parent, summary.read_text()


def test_quick_benchmarks_run():
    """The engine comparisons (mpitrain MPI and Horovod, MultiWorkerMirrored,
    ParameterServerStrategy) for LR, in one invocation as `bench all` runs them."""
    out, summary = bench("engines,async_engines", "--quick", "--models", "lr")
    # each baseline runs as TensorFlow ships and with oneDNN's kernels, as mpitrain runs
    for csv_name, engines in (("engines.csv", {"mpi": "True", "horovod": "True",
                                               "mwms-onednn": "True", "mwms": None}),
                              ("async_engines.csv", {"mpitrain-async": "True",
                                                     "ParameterServerStrategy-onednn": "True",
                                                     "ParameterServerStrategy": None})):
        with open(out / csv_name, newline="") as f:
            rows = {row["engine"]: row for row in csv.DictReader(f)}
        assert set(rows) == set(engines)
        for engine, onednn in engines.items():  # None: TensorFlow's default for this CPU
            assert rows[engine]["onednn"] in ((onednn,) if onednn else ("True", "False"))
        assert (out / csv_name).with_suffix(".png").stat().st_size > 0
    assert "| engines |" in summary and "| async_engines |" in summary and "cores" in summary
    # every ratio's floor (our compute alone) beside it, and the CSVs as tables
    assert "lr: mpi / horovod epoch time's floor" in summary
    assert "Minutes per benchmark: engines " in summary and ", async_engines " in summary
    assert "## engines.csv" in summary and "| lr | mpi | 2 |" in summary


def test_unknown_benchmark_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "bench", "nonsense"], cwd=REPO,
                            env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "benchmarks:" in result.stdout
