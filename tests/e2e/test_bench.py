"""Smoke tests of the benchmark suite: every benchmark's --quick mode runs end to end
and writes its CSVs, figures and summary, so a benchmark that no longer runs fails
here instead of rotting. They check that the suite runs, not its targets (those are
measured on a quiet machine: docs/benchmarks.md). And a benchmark rank that raises
ends its whole job at once."""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import BENCHMARKS
from conftest import REPO, mnist_dir, mpi_env, mpirun_cmd, netns_cluster_turn, run_bounded

#: the benchmarks whose smoke brings the emulated cluster up (and down): they take turns
#: with tests/e2e/test_netns.py
ON_THE_EMULATED_CLUSTER = ("netns", "compression", "servers")
#: benchmarks whose smoke another test file runs, beside what it checks of the same setup
SMOKED_ELSEWHERE = {"mpis": "tests/e2e/test_mpis.py"}


def bench(names, *args, timeout=1500):
    """``python -m bench NAMES --quick ARGS``: (its output directory, summary.md's text)."""
    # the benchmarks read MNIST from MPITRAIN_DATA_DIR: the same copy the tests use
    result = run_bounded([sys.executable, "-m", "bench", ",".join(names), "--quick", *args],
                         timeout, env=mpi_env(MPITRAIN_DATA_DIR=str(mnist_dir())))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = Path(result.stdout.split("summary: ")[-1].split()[0])
    text = summary.read_text()
    # every benchmark ran to its end ("ran to completion: failed" is what a crash leaves)
    assert f"Minutes per benchmark: {names[0]} " in text and "failed:" not in text
    return summary.parent, text


def rows_of(path: Path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_quick_benchmark_runs():
    """Every benchmark but those on the emulated cluster, in one invocation as `bench
    all` runs them (a benchmark added to bench/__init__.py is in it by itself)."""
    names = [name for name in BENCHMARKS
             if name not in ON_THE_EMULATED_CLUSTER and name not in SMOKED_ELSEWHERE]
    out, summary = bench(names)
    for name in names:
        assert f"| {name} |" in summary, f"{name}: no check in summary.md"
    # each baseline runs as TensorFlow ships and, where that is not already oneDNN's
    # kernels (as mpitrain runs), with them
    for csv_name, ours, baseline in (("engines.csv", ("mpi", "mpi-horovod-env", "horovod"),
                                      "mwms"),
                                     ("async_engines.csv",
                                      ("mpitrain-async", "mpitrain-async-defaults"),
                                      "ParameterServerStrategy")):
        rows = {row["engine"]: row for row in rows_of(out / csv_name)}
        assert all(rows[engine]["onednn"] == "True" for engine in ours)
        shipped = rows[baseline]["onednn"]
        assert set(rows) == {*ours, baseline, *([f"{baseline}-onednn"]
                                                if shipped == "False" else [])}
        assert rows.get(f"{baseline}-onednn", {"onednn": "True"})["onednn"] == "True"
        assert (out / csv_name).with_suffix(".png").stat().st_size > 0
    # every ratio's floor (our compute alone) beside it, and the CSVs as tables
    assert "lr: mpi / horovod epoch time's floor" in summary
    # judged on one TensorFlow; each engine on its own stack only reported, labelled
    tf = {row["engine"]: row["tensorflow"] for row in rows_of(out / "engines.csv")}
    assert tf["mpi-horovod-env"] == tf["horovod"] and tf["mpi"] == tf["mwms"], tf
    assert f"lr: mpi / horovod epoch time (same TensorFlow, {tf['horovod']}) | " in summary
    if tf["mpi"] != tf["horovod"]:
        assert f"lr: mpi / horovod epoch time (each on its own stack: TensorFlow " \
               f"{tf['mpi']} / {tf['horovod']}) | <= " not in summary  # reported, not judged
        assert f"lr: mpi / horovod epoch time (each on its own stack: TensorFlow " \
               f"{tf['mpi']} / {tf['horovod']}) | " in summary
    assert "## engines.csv" in summary and "| lr | mpi | 2 |" in summary
    assert [r["where"] for r in rows_of(out / "overlap.csv")] == ["shared memory"]
    # bench scale times its launch on every rank: start-up, gathers, telemetry's size
    assert [(r["np"], float(r["gather_s"]) >= 0) for r in rows_of(out / "scale_ranks.csv")] \
        == [("3", True), ("3", True)]
    check_ddp(out, summary)


def check_ddp(out: Path, summary: str) -> None:
    """PyTorch DDP against mpitrain: both sides at 1 and 2 workers, each model of the
    smoke, with the compute-only steps beside them; skipped only where set-up was told
    not to install PyTorch."""
    if "| ddp | PyTorch DDP | skipped |" in summary:
        if os.environ.get("CI") and not os.environ.get("MPITRAIN_NO_TORCH"):
            pytest.fail("bench ddp was skipped: no .venv-torch (bash setup.sh installs it)")
        return
    rows = rows_of(out / "ddp.csv")
    assert {(r["model"], r["side"], r["workers"]) for r in rows} == {
        (model, side, workers) for model in ("lenet", "resnet") for side in ("mpitrain", "ddp")
        for workers in ("1", "2")}
    for r in rows:
        assert float(r["epoch_time_s"]) > 0 and 0 <= float(r["test_accuracy"]) <= 1
        if r["workers"] == "2":  # the compute-only step of each side
            assert float(r["compute_only_ms"]) > 0
    assert "| ddp | lenet: mpitrain / DDP epoch time, 2 workers, whole run |" in summary
    assert "| ddp | resnet: compute-only step, TensorFlow (mpitrain) / PyTorch" in summary


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_benchmarks_on_the_emulated_cluster_run():
    with netns_cluster_turn():
        out, summary = bench(ON_THE_EMULATED_CLUSTER)
    if "| netns | emulated cluster | skipped |" in summary:
        pytest.skip("network namespaces unavailable here: " + summary.split("skipped |")[1][:80])
    assert {r["model"] for r in rows_of(out / "netns.csv")} == {"lr"}
    assert {(r["model"], r["mode"], r["compression"])
            for r in rows_of(out / "compression.csv")} == {("lenet", "sync", "none"),
                                                          ("lenet", "sync", "fp16")}
    # one server and two, each on a node of its own, the 3 workers on three others
    servers = rows_of(out / "servers.csv")
    assert [(r["model"], r["servers"], r["server_nodes"]) for r in servers] == [
        ("lr", "1", "node0"), ("lr", "2", "node0 node1")]
    assert all(r["worker_nodes"] == "node3 node4 node5" and float(r["updates_per_s"]) > 0
               for r in servers)


def test_the_other_smoke_runs_exist():
    for name, path in SMOKED_ELSEWHERE.items():
        assert f'"bench", "{name}", "--quick"' in (REPO / path).read_text(), path


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
    result = run_bounded(mpirun_cmd(3, "-c", code, module=None), 300)
    assert result.returncode != 0
    assert time.monotonic() - began < 60
    assert "bench: error on rank 1" in result.stderr
    assert "RuntimeError: a broken benchmark" in result.stderr


def test_unknown_benchmark_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "bench", "nonsense"], cwd=REPO,
                            env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "benchmarks:" in result.stdout
