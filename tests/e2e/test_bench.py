"""Smoke tests of the benchmark suite: every benchmark's --quick mode runs end to end
and writes its CSVs, figures and summary, so a benchmark that no longer runs fails
here instead of rotting. They check that the suite runs, not its targets (those are
measured on a quiet machine: docs/benchmarks.md). The engine comparisons and the
benchmarks on the emulated cluster have files of their own
(test_bench_smoke_engines.py, test_bench_smoke_cluster.py), so three pytest workers
share the smoke. And a benchmark rank that raises ends its whole job at once."""

import subprocess
import sys
import time

import pytest

from bench import BENCHMARKS
from conftest import (ENGINE_COMPARISONS, ON_THE_EMULATED_CLUSTER, REPO, SMOKED_ELSEWHERE,
                      bench, mpi_env, mpirun_cmd, read_rows, run_bounded)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_quick_benchmark_runs():
    """Every benchmark but the engine comparisons and those on the emulated cluster
    (their own files), in one invocation as `bench all` runs them (a benchmark added to
    bench/__init__.py is in it by itself)."""
    names = [name for name in BENCHMARKS if name not in ENGINE_COMPARISONS
             and name not in ON_THE_EMULATED_CLUSTER and name not in SMOKED_ELSEWHERE]
    out, _ = bench(names)
    assert [r["where"] for r in read_rows(out / "overlap.csv")] == ["shared memory"]
    # bench scale times its launch on every rank: start-up, gathers, telemetry's size
    assert [(r["np"], float(r["gather_s"]) >= 0) for r in read_rows(out / "scale_ranks.csv")] \
        == [("3", True), ("3", True)]


def test_the_other_smoke_runs_exist():
    for path, call in SMOKED_ELSEWHERE.values():
        assert call in (REPO / path).read_text(), path


def test_a_failing_rank_ends_the_benchmark_job_at_once():
    """A rank of a benchmark's job that raises ends the whole job in seconds with its
    traceback, while the others wait for it in a barrier bounded at 600 s (before,
    they waited the 600 s out)."""
    code = ("from bench.common import on_every_rank\n"
            "def rank_side():\n"
            "    from mpitrain.comm import Comm\n"
            "    comm = Comm.world(timeout=600)\n"
            "    if comm.rank == 1:\n"
            "        raise RuntimeError('a broken benchmark')\n"
            "    comm.barrier()\n"
            "on_every_rank(rank_side)\n")
    began = time.monotonic()
    result = run_bounded(mpirun_cmd(3, "-c", code, module=None), 500)
    assert result.returncode != 0
    assert time.monotonic() - began < 300  # not the barrier's 600 s
    assert "bench: error on rank 1" in result.stderr
    assert "RuntimeError: a broken benchmark" in result.stderr


def test_unknown_benchmark_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "bench", "nonsense"], cwd=REPO,
                            env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "benchmarks:" in result.stdout
