"""End-to-end: training streamed from a shard set (``mpitrain data pack`` of the real
MNIST, then ``--data DIR``) under real mpirun, sync and async, with each worker writing
the ids of every batch it trains on (MPITRAIN_EXAMPLE_LOG) so the examples are counted:
every one once an epoch, also across a sync run killed mid-epoch and resumed."""

import sys
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import (finish_bounded, kill_tree, mnist_dir, mnist_size, mpi_env, mpirun,
                      mpirun_cmd, read_rows, run_bounded, start_bounded, wait_while_running)
from mpitrain.data.shardset import EXAMPLE_LOG
from mpitrain.run.checkpoint import saved_position

WORKERS, BATCH = 2, 10


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The real MNIST packed by the CLI into shards of 2 MB (uneven: the last is short)."""
    dest = tmp_path_factory.mktemp("stream") / "mnist-shards"
    done = run_bounded([sys.executable, "-m", "mpitrain", "data", "pack", mnist_dir(), dest,
                        "--shard-mb", "2"], timeout=300)
    assert done.returncode == 0, done.stderr
    assert "train in" in done.stdout
    checked = run_bounded([sys.executable, "-m", "mpitrain", "data", "check", dest], 120)
    assert checked.returncode == 0 and "every shard is whole" in checked.stdout, checked
    return dest


def logged(directory: Path) -> dict:
    """{worker: [(epoch, [ids]) per step, in order]} from MPITRAIN_EXAMPLE_LOG's files."""
    out = {}
    for path in sorted(directory.glob("worker-*.txt")):
        steps = []
        for line in path.read_text().splitlines():
            epoch, *ids = map(int, line.split())
            steps.append((epoch, ids))
        out[int(path.stem.split("-")[1])] = steps
    return out


def assert_every_example_once_an_epoch(steps_by_worker: dict, epochs: int) -> None:
    n = mnist_size("train")
    by_epoch = defaultdict(list)
    for steps in steps_by_worker.values():
        for epoch, ids in steps:
            by_epoch[epoch] += ids
    assert sorted(by_epoch) == list(range(1, epochs + 1))
    for epoch, ids in by_epoch.items():
        assert len(ids) == WORKERS * (n // WORKERS), epoch  # all but N mod W...
        assert len(set(ids)) == len(ids), f"epoch {epoch}: an example twice"  # ...once
        assert min(ids) >= 0 and max(ids) < n


@pytest.mark.slow
def test_a_sync_run_killed_mid_epoch_and_resumed_trains_every_example_once(shards,
                                                                           tmp_path):
    results, first, second = tmp_path / "results", tmp_path / "log1", tmp_path / "log2"
    first.mkdir()
    second.mkdir()
    per_epoch = -(-(mnist_size("train") // WORKERS) // BATCH)
    epochs = 3
    job = start_bounded(mpirun_cmd(WORKERS + 1, "lr", "--data", shards, "--batch-size", BATCH,
                                   "--epochs", epochs, "--checkpoint-steps", 100,
                                   "--results-dir", results, "--quiet"),
                        env=mpi_env(**{EXAMPLE_LOG: first}))

    def checkpointed_mid_epoch():
        runs = [d for d in results.glob("*") if d.is_dir()] if results.exists() else []
        position = saved_position(runs[0]) if runs else None
        return (runs[0], position[0]) if position and position[0] >= per_epoch + 100 else None

    run_dir, _ = wait_while_running(job, checkpointed_mid_epoch, timeout=300)
    kill_tree(job.pid)
    finish_bounded(job, 60)
    step = saved_position(run_dir)[0]
    assert per_epoch < step < epochs * per_epoch and step % per_epoch, step  # mid-epoch
    before = logged(first)
    assert all(len(s) >= step for s in before.values())  # (trained on, then lost)

    resumed = mpirun(WORKERS + 1, "lr", "--resume", run_dir, "--quiet", timeout=600,
                     env=mpi_env(**{EXAMPLE_LOG: second}))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = logged(second)
    assert all(len(s) == epochs * per_epoch - step for s in after.values())
    assert_every_example_once_an_epoch(
        {w: before[w][:step] + after[w] for w in range(WORKERS)}, epochs)
    done = read_rows(results / "runs.csv")[-1]
    assert done["status"] == "ok" and done["dataset"] == "shards"
    assert float(done["test_accuracy"]) > 0.85, done  # LR on MNIST; chance is 0.1


@pytest.mark.slow
def test_async_streams_every_example_once_an_epoch(shards, tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    done = mpirun(WORKERS + 1, "lr", "--data", shards, "--async", "--batch-size", BATCH,
                  "--epochs", 2, "--eval-examples", 2000, "--results-dir", tmp_path,
                  "--quiet", timeout=600, env=mpi_env(**{EXAMPLE_LOG: log}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_every_example_once_an_epoch(logged(log), 2)
    row = read_rows(tmp_path / "runs.csv")[-1]
    assert row["status"] == "ok" and float(row["test_accuracy"]) > 0.85, row


def test_a_damaged_shard_set_ends_the_job_with_one_line(shards, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in shards.iterdir():
        (broken / path.name).symlink_to(path)
    victim = sorted(broken.glob("train-*.npz"))[3]
    victim.unlink()
    done = mpirun(WORKERS + 1, "lr", "--data", broken, "--results-dir", tmp_path / "r",
                  timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("mpitrain: error")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-2000:]
    assert f"{victim}: missing; check it with 'mpitrain data check" in errors[0]
