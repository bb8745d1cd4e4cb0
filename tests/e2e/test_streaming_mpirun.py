"""End-to-end: training streamed from a shard set (``mpitrain data pack`` of the real
MNIST, then ``--data DIR``) and from an image folder (``--stream``) under real mpirun,
sync and async, with each worker writing the ids of every batch it trains on
(MPITRAIN_EXAMPLE_LOG) so the examples are counted: every one once an epoch, also
across a sync run killed mid-epoch and resumed."""

import re
import shutil
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


def assert_every_example_once_an_epoch(steps_by_worker: dict, epochs: int,
                                       n: int = 0) -> None:
    n = n or mnist_size("train")
    by_epoch = defaultdict(list)
    for steps in steps_by_worker.values():
        for epoch, ids in steps:
            by_epoch[epoch] += ids
    assert sorted(by_epoch) == list(range(1, epochs + 1))
    for epoch, ids in by_epoch.items():
        assert len(ids) == WORKERS * (n // WORKERS), epoch  # all but N mod W...
        assert len(set(ids)) == len(ids), f"epoch {epoch}: an example twice"  # ...once
        assert min(ids) >= 0 and max(ids) < n


EPOCHS = 3


@pytest.fixture(scope="module")
def killed(shards, tmp_path_factory):
    """Sync LR on the shards at 2 workers (a checkpoint every 100 steps), SIGKILLed once a
    checkpoint past the first epoch is on disk: (its results directory, the steps
    of its checkpoint, what each worker logged)."""
    root = tmp_path_factory.mktemp("killed")
    results, log = root / "results", root / "log"
    log.mkdir()
    per_epoch = -(-(mnist_size("train") // WORKERS) // BATCH)
    job = start_bounded(mpirun_cmd(WORKERS + 1, "lr", "--data", shards, "--batch-size", BATCH,
                                   "--epochs", EPOCHS, "--checkpoint-steps", 100,
                                   "--results-dir", results, "--quiet"),
                        env=mpi_env(**{EXAMPLE_LOG: log}))

    def checkpointed_mid_epoch():
        runs = [d for d in results.glob("*") if d.is_dir()] if results.exists() else []
        position = saved_position(runs[0]) if runs else None
        return runs[0] if position and position[0] >= per_epoch + 100 else None

    run_dir = wait_while_running(job, checkpointed_mid_epoch, timeout=300)
    kill_tree(job.pid)
    finish_bounded(job, 60)
    step = saved_position(run_dir)[0]
    assert per_epoch < step < EPOCHS * per_epoch and step % per_epoch, step  # mid-epoch
    before = logged(log)
    assert all(len(s) >= step for s in before.values())  # (trained on, then lost)
    return results, run_dir.name, step, before


def resume_a_copy(killed, tmp_path, np_):
    """The killed run resumed from a copy of its results at ``np_`` ranks: (its results
    directory, what each worker logged)."""
    results, name, _, _ = killed
    copy, log = tmp_path / "results", tmp_path / "log"
    shutil.copytree(results, copy)
    log.mkdir()
    resumed = mpirun(np_, "lr", "--resume", copy / name, "--quiet", timeout=600,
                     env=mpi_env(**{EXAMPLE_LOG: log}))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return copy, logged(log)


@pytest.mark.slow
def test_a_sync_run_killed_mid_epoch_and_resumed_trains_every_example_once(killed,
                                                                           tmp_path):
    _, _, step, before = killed
    results, after = resume_a_copy(killed, tmp_path, WORKERS + 1)
    per_epoch = -(-(mnist_size("train") // WORKERS) // BATCH)
    assert all(len(s) == EPOCHS * per_epoch - step for s in after.values())
    assert_every_example_once_an_epoch(
        {w: before[w][:step] + after[w] for w in range(WORKERS)}, EPOCHS)
    done = read_rows(results / "runs.csv")[-1]
    assert done["status"] == "ok" and done["dataset"] == "shards"
    assert float(done["test_accuracy"]) > 0.85, done  # LR on MNIST; chance is 0.1


@pytest.mark.slow
def test_resumed_on_three_workers_it_repeats_less_than_a_step(killed, tmp_path):
    """The same run resumed at -np 4: the global batch of 20 becomes 3 x 7; the epoch it
    was killed in repeats fewer than one new step's examples (21) and leaves none out;
    the epochs before and after hold every example once."""
    _, _, step, before = killed
    results, after = resume_a_copy(killed, tmp_path, 4)
    assert sorted(after) == [0, 1, 2]
    n, per_epoch = mnist_size("train"), -(-(mnist_size("train") // WORKERS) // BATCH)
    killed_in = step // per_epoch + 1
    ids = defaultdict(list)
    for steps in [before[w][:step] for w in range(WORKERS)] + list(after.values()):
        for epoch, batch in steps:
            ids[epoch] += batch
    for epoch, seen in ids.items():
        workers = WORKERS if epoch < killed_in else 3
        assert len(set(seen)) == workers * (n // workers), epoch  # none left out
        repeated = len(seen) - len(set(seen))
        assert repeated < 21 if epoch == killed_in else repeated == 0, (epoch, repeated)
    row = read_rows(results / "runs.csv")[-1]
    assert row["status"] == "ok" and row["rescaled"] and row["workers"] == "3", row


@pytest.mark.slow
def test_async_with_two_servers_streams_every_example_once_an_epoch(shards, tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    done = mpirun(WORKERS + 2, "lr", "--data", shards, "--async", "--servers", 2,
                  "--batch-size", BATCH,
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


@pytest.mark.slow
def test_an_image_folder_streamed_as_it_is(tmp_path):
    """--data DIR --stream: JPEG class folders decoded by each worker as it trains."""
    from unit.test_user_data import write_images

    images = write_images(tmp_path / "imgs", n=300, classes=5, channels=3, split=True,
                          suffix=".jpg")
    log = tmp_path / "log"
    log.mkdir()
    done = mpirun(WORKERS + 1, "lenet", "--data", images, "--stream", "--batch-size", 16,
                  "--epochs", 4, "--results-dir", tmp_path / "r", "--quiet", timeout=600,
                  env=mpi_env(**{EXAMPLE_LOG: log}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_every_example_once_an_epoch(logged(log), 4, n=240)
    row = read_rows(tmp_path / "r" / "runs.csv")[-1]
    assert (row["status"], row["dataset"], row["input_shape"]) == ("ok", "images", "24x24x3")
    assert float(row["test_accuracy"]) >= 0.6, row  # five classes: chance is 0.2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shards_deleted_mid_run_end_it_with_one_line(tmp_path, mode):
    """Every training shard deleted once training is under way: the shards a worker has
    open go on being read; the first it has not opened yet ends the run with a line
    naming it (exit 1, the run recorded as failed with it), not a hang."""
    small = tmp_path / "small"
    packed = run_bounded([sys.executable, "-m", "mpitrain", "data", "pack", mnist_dir(),
                          small, "--shard-mb", "0.5"], timeout=300)
    assert packed.returncode == 0, packed.stderr
    results = tmp_path / "r"
    job = start_bounded(mpirun_cmd(WORKERS + 1, "lr", "--data", small, "--batch-size", BATCH,
                                   "--epochs", 3, "--results-dir", results,
                                   *(["--async"] if mode == "async" else [])))

    def training():
        status = list(results.glob("*/status.json")) if results.exists() else []
        return status and '"step"' in status[0].read_text()

    wait_while_running(job, training, timeout=300)
    for shard in small.glob("train-*.npz"):
        shard.unlink()
    done = finish_bounded(job, 120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("mpitrain: error")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-2000:]
    assert re.search(r"train-\d+-of-\d+\.npz: cannot be read \(No such file or directory\); "
                     "check it with 'mpitrain data check", errors[0]), errors
    row = read_rows(results / "runs.csv")[-1]
    assert row["status"] == "failed" and "cannot be read" in row["reason"], row
