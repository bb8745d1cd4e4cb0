"""Past four workers: the protocols, recovery, checkpoint/resume and telemetry at -np 17
and 9 under real mpirun (one host, oversubscribed; LR on the real MNIST), in two
launches whose runs the tests share (tests/helpers/cli_runs.py: each rank starts
TensorFlow once per launch).

* -np 17, under ``mpirun --enable-recovery``: sync LR with a checkpoint per epoch;
  async with ``--servers 2``; async LR whose rank 5 is SIGKILLed after its first
  epoch (last: the killed rank cannot take part in a run after it).
* -np 9: both the sync and the killed-worker run resumed from their checkpoints with
  one more epoch, onto the 8 workers there are (the rescaling of docs/faults.md).

Accuracy is the learning-rate defaults' business (their own tests): here only a floor
that a run which learned nothing fails."""

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from conftest import (REPO, finish_bounded, mnist_dir, mnist_shard, mpirun_cmd, read_rows,
                      start_bounded, wait_while_running)
from mpitrain.data.shards import batches_per_epoch

pytestmark = pytest.mark.slow

BIG, SMALL = 17, 9
#: the rank killed in the async run at -np 17
VICTIM = 5
#: a run that learned nothing stays near 10%; LR reaches 80-90% here
FLOOR = 0.5
#: async runs: LR in batches of 5 at lr 0.05 (docs/faults.md's recovery runs), 250 steps
#: a worker an epoch at 16 workers: 4,000 updates an epoch, several seconds of them after
#: the victim is dropped (at once: it ran on rank 0's host)
ASYNC = ["--batch-size", "5", "--lr", "0.05"]
#: every wait of the first launch, from its start (17 ranks start in 1-2 minutes on two
#: cores beside other tests; its three runs then train for well under a minute)
FIRST_LAUNCH_BOUND = 780


def spec(out: Path, runs: dict) -> Path:
    """tests/helpers/cli_runs.py's RUNS.json for ``runs`` ({name: mpitrain arguments}),
    each new run writing into out/name (a resumed one goes on in its own directory)."""
    def where(name, args):
        return [] if "--resume" in args else ["--data-dir", mnist_dir(), "--results-dir",
                                              out / name]
    path = out / "runs.json"
    path.write_text(json.dumps([[*map(str, [*args, "--quiet", *where(name, args)])]
                                for name, args in runs.items()]))
    return path


def launch(np_: int, runs: Path, *flags):
    return start_bounded(mpirun_cmd(np_, REPO / "tests" / "helpers" / "cli_runs.py", runs,
                                    "--codes", module=None, flags=("--oversubscribe", *flags)))


def the_run(results: Path) -> Path:
    """The one run directory in ``results`` (None until it has its config.json)."""
    found = [p for p in results.glob("*-lr-*") if (p / "config.json").is_file()] \
        if results.is_dir() else []
    return found[0] if found else None


def evaluated(run_dir: Path, epoch: float) -> bool:
    try:
        return any(float(r["epoch"]) >= epoch for r in read_rows(run_dir / "curve.csv"))
    except (OSError, KeyError, ValueError):
        return False


def pids(run_dir: Path, meta: str = "config.json") -> list:
    return [rank["pid"] for rank in json.loads((run_dir / meta).read_text())["ranks"]]


def alive(processes) -> list:
    return [p for p in processes if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def codes(stderr: str) -> list:
    return [line.split()[-1] for line in stderr.splitlines() if line.startswith("cli_runs: run")]


def ranks_in(rows) -> set:
    return {int(r["rank"]) for r in rows}


def csv_rows(run_dir: Path) -> dict:
    """The rows of a run's CSV files: its per-rank telemetry, curve and staleness."""
    return {name: read_rows(run_dir / f"{name}.csv")
            for name in ("telemetry", "timing", "comm", "curve", "staleness")
            if (run_dir / f"{name}.csv").is_file()}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The -np 17 launch: {name: run directory}, its stdout, the victim's pid, and what
    each run had written after it (``row``: its runs.csv row; ``files``: its per-rank
    files' rows; ``status``: status.json), which the resumed sessions extend."""
    out = tmp_path_factory.mktemp("np17")
    runs = spec(out, {
        "sync": ["lr", "--epochs", "2", "--checkpoint-every", "1", "--sample-interval", "0.5"],
        "servers": ["lr", "--async", "--servers", "2", "--epochs", "1"],
        "lost": ["lr", "--async", *ASYNC, "--epochs", "2",
                 "--checkpoint-steps", "1000", "--sample-interval", "0.5"]})
    deadline = time.monotonic() + FIRST_LAUNCH_BOUND
    proc = launch(BIG, runs, "--enable-recovery")
    lost = wait_while_running(proc, lambda: the_run(out / "lost"),
                              deadline - time.monotonic())
    wait_while_running(proc, lambda: evaluated(lost, 1), deadline - time.monotonic())
    victim = pids(lost)[VICTIM]
    os.kill(victim, signal.SIGKILL)
    done = finish_bounded(proc, max(1.0, deadline - time.monotonic()))
    assert done.returncode == 0, done.stderr[-3000:]
    assert codes(done.stderr) == ["0", "0", "0"], done.stderr[-3000:]
    dirs = {name: the_run(out / name) for name in ("sync", "servers", "lost")}
    return {"dirs": dirs, "stdout": done.stdout, "victim": victim,
            "row": {name: read_rows(d.parent / "runs.csv")[-1] for name, d in dirs.items()},
            "files": {name: csv_rows(d) for name, d in dirs.items()},
            "status": {name: json.loads((d / "status.json").read_text())
                       for name, d in dirs.items()}}


@pytest.fixture(scope="module")
def resumed(first, tmp_path_factory):
    """The -np 9 launch: the sync and the killed-worker runs resumed for a third epoch."""
    out = tmp_path_factory.mktemp("np9")
    dirs = first["dirs"]
    runs = spec(out, {name: ["lr", "--resume", dirs[name], "--epochs", "3"]
                      for name in ("sync", "lost")})
    done = finish_bounded(launch(SMALL, runs), 600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert codes(done.stderr) == ["0", "0"], done.stderr[-3000:]
    return done


def resumed_row(run_dir: Path) -> dict:
    """The runs.csv row of the run's second session (the -np 9 one)."""
    rows = read_rows(run_dir.parent / "runs.csv")
    assert len(rows) == 2, rows
    return rows[1]


def this_session(files: dict, before: dict) -> dict:
    """The rows the resumed session appended to each per-rank file."""
    return {name: rows[len(before[name]):] for name, rows in files.items()
            if name in ("telemetry", "timing", "comm")}


def test_sync_at_17_ranks(first):
    """Sync LR on 16 workers: every rank in the run's metadata and telemetry, a
    checkpoint per epoch, the curve's epochs, and it learned."""
    run_dir, row = first["dirs"]["sync"], first["row"]["sync"]
    per_epoch = batches_per_epoch(mnist_shard(BIG - 1), 100)
    assert (row["status"], row["mode"], row["np"], row["workers"]) == ("ok", "sync", "17", "16")
    assert int(row["global_batch"]) == 1600 and int(row["steps"]) == 2 * per_epoch, row
    assert float(row["test_accuracy"]) > FLOOR, row
    ranks = pids(run_dir)
    assert len(set(ranks)) == BIG  # 17 processes, each in config.json
    files = first["files"]["sync"]
    assert [float(r["epoch"]) for r in files["curve"]] == [0, 1, 2]
    assert (run_dir / "checkpoint.npz").is_file()
    for name in ("telemetry", "timing", "comm"):
        assert ranks_in(files[name]) == set(range(BIG)), name
    # one timing row per rank and epoch
    assert len(files["timing"]) == 2 * BIG
    assert first["status"]["sync"]["status"] == "ok"


def test_two_parameter_servers_at_17_ranks(first):
    """--servers 2 on 15 workers: both servers apply every push once."""
    row, files = first["row"]["servers"], first["files"]["servers"]
    assert (row["status"], row["servers"], row["workers"]) == ("ok", "2", "15"), row
    applied = dict(pair.split(":") for pair in row["applied_by_server"].split())
    assert applied == {"0": row["steps"], "1": row["steps"]}, row
    assert int(row["steps"]) == 15 * batches_per_epoch(mnist_shard(BIG - 2), 100)
    hist = files["staleness"]
    assert {r["server"] for r in hist} == {"0", "1"}
    assert {int(r["worker"]) for r in hist} == set(range(2, BIG))
    for server in "01":
        assert sum(int(r["count"]) for r in hist if r["server"] == server) == int(row["steps"])
    for name in ("telemetry", "comm"):
        assert ranks_in(files[name]) == set(range(BIG)), name
    # (the server of the second share, rank 1, keeps no per-epoch timing)
    assert ranks_in(files["timing"]) >= set(range(BIG)) - {1}


def test_a_worker_killed_at_17_ranks_is_dropped_and_the_run_finishes(first):
    """Under --enable-recovery, rank 5 SIGKILLed after epoch 1: dropped at once, its
    steps go to the 15 others, the run makes its planned updates, and every rank but
    the lost one is in the telemetry; no process is left."""
    run_dir, row = first["dirs"]["lost"], first["row"]["lost"]
    planned = 2 * 16 * batches_per_epoch(mnist_shard(BIG - 1), 5)
    assert (row["status"], row["mode"], row["np"]) == ("ok", "async", "17"), row
    assert int(row["steps"]) == planned and row["updates_short"] == "0", row
    assert f"rank {VICTIM} on" in row["lost_workers"], row
    assert "its process died" in row["lost_workers"], row
    assert float(row["test_accuracy"]) > FLOOR, row
    [lost] = first["status"]["lost"]["lost_workers"]
    assert (lost["rank"], lost["pid"]) == (VICTIM, first["victim"])
    assert 0 < lost["update"] < planned
    assert f"lost rank {VICTIM} on" in first["stdout"]
    assert "training continues with 15 worker(s)" in first["stdout"], first["stdout"][-3000:]
    files = first["files"]["lost"]
    everyone_else = set(range(BIG)) - {VICTIM}
    for name in ("telemetry", "timing", "comm"):
        assert ranks_in(files[name]) == everyone_else, name
    assert sum(int(r["count"]) for r in files["staleness"]) == planned
    assert (run_dir / "checkpoint.npz").is_file()
    assert alive(pids(run_dir)) == []


def test_the_sync_run_resumed_on_9_ranks(first, resumed):
    """The -np 17 sync run resumed at -np 9 for a third epoch: the global batch kept
    (8 workers x 200), one continuous curve, this session's telemetry from its 9 ranks."""
    run_dir = first["dirs"]["sync"]
    row = resumed_row(run_dir)
    assert (row["status"], row["np"], row["workers"], row["resumed"]) == \
        ("ok", "9", "8", "True"), row
    assert "-np 17 -> 9" in row["rescaled"] and "global batch 1600 kept" in row["rescaled"]
    assert (int(row["batch_size"]), int(row["global_batch"])) == (200, 1600), row
    assert float(row["test_accuracy"]) > FLOOR, row
    curve = read_rows(run_dir / "curve.csv")
    assert [float(r["epoch"]) for r in curve] == [0, 1, 2, 3]
    steps = [int(r["step"]) for r in curve]
    assert steps == sorted(set(steps)) and steps[-1] == int(row["steps"])
    [meta] = run_dir.glob("resumed-*.json")
    assert len(set(pids(run_dir, meta.name))) == SMALL
    for name, rows in this_session(csv_rows(run_dir), first["files"]["sync"]).items():
        assert ranks_in(rows) == set(range(SMALL)), name


def test_the_run_that_lost_a_worker_resumed_on_9_ranks(first, resumed):
    """The killed-worker run resumed at -np 9: its 8 workers share the updates left,
    the loss stays in its history, rank 5 (a live worker now) is in this session's
    telemetry, and staleness.csv counts every update once."""
    run_dir = first["dirs"]["lost"]
    row = resumed_row(run_dir)
    planned = 3 * 16 * batches_per_epoch(mnist_shard(BIG - 1), 5)
    assert (row["status"], row["np"], row["workers"], row["resumed"]) == \
        ("ok", "9", "8", "True"), row
    assert "-np 17 -> 9 (16 -> 8 workers)" in row["rescaled"], row
    assert int(row["steps"]) == planned and row["updates_short"] == "0", row
    assert f"rank {VICTIM} on" in row["lost_workers"], row
    assert float(row["test_accuracy"]) > FLOOR, row
    assert [float(r["epoch"]) for r in read_rows(run_dir / "curve.csv")][-1] == 3
    files = csv_rows(run_dir)
    for name, rows in this_session(files, first["files"]["lost"]).items():
        assert ranks_in(rows) == set(range(SMALL)), name
    assert sum(int(r["count"]) for r in files["staleness"]) == planned
    assert alive(pids(run_dir, next(run_dir.glob("resumed-*.json")).name)) == []
