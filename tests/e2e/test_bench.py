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


@pytest.mark.parametrize("name,args,csv_name,rows", [
    ("comm", [], "comm.csv", 9),  # 3 sizes x -np 2/3/4
    ("engines", ["--models", "lr"], "engines.csv", 3),  # mpi, horovod, MWMS
    ("async_engines", ["--models", "lr"], "async_engines.csv", 2),  # mpitrain, PSS
])
def test_quick_benchmark_runs(name, args, csv_name, rows):
    out, summary = bench(name, "--quick", *args)
    with open(out / csv_name, newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == rows
    assert (out / csv_name).with_suffix(".png").stat().st_size > 0
    assert f"| {name} |" in summary and "cores" in summary


def test_unknown_benchmark_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "bench", "nonsense"], cwd=REPO,
                            env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "benchmarks:" in result.stdout
