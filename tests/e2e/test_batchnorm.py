"""Models with state that is not trained, under real mpirun -np 3: BatchNorm moving
statistics (buffers) and a Dropout seed (tests/helpers/bn_model.py), and resnet.

* sync: the server checks one checksum of weights + buffers from every worker at
  every evaluation (a difference fails the run with ReplicaDrift); the buffers it
  checkpoints and evaluates are the data's real statistics at the final weights;
* async: the server evaluates with the mean of the workers' latest statistics;
* a stopped and resumed sync run ends bit for bit where an uninterrupted one does;
* resnet trains on small learnable images (one worker; at -np 3, sync and async, on
  a CIFAR-10 directory: test_your_model).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (BN_MODEL_SPEC, LOCAL_HOSTFILE, learnable_images, mpi_env, mpirun,
                      named_runs_in_one_launch, read_rows)

SHAPE, CLASSES = (12, 12, 1), 4


@pytest.fixture(scope="module")
def bn_data(tmp_path_factory):
    """Learnable 12x12 images, 4 classes, as float32 0..255 (not scaled by the loader):
    BatchNorm's statistics are far from their initial 0 and 1."""
    x, y = learnable_images(2400, 1, size=12, channels=1, classes=CLASSES)
    xt, yt = learnable_images(600, 2, size=12, channels=1, classes=CLASSES)
    path = tmp_path_factory.mktemp("bn") / "bn.npz"
    np.savez(path, x_train=x.astype(np.float32), y_train=y, x_test=xt.astype(np.float32),
             y_test=yt)
    return path


def train(np_, data, results, *extra, timeout=300):
    result = mpirun(np_, BN_MODEL_SPEC, "--data", data, "--batch-size", "32",
                    "--results-dir", results, "--quiet", *extra, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    row = read_rows(Path(results) / "runs.csv")[-1]
    assert row["status"] == "ok", row
    return Path(results) / row["run"], row


def checkpoint(run_dir):
    with np.load(run_dir / "checkpoint.npz") as f:
        return f["weights"], f["buffers"]


def check_statistics(run_dir, row, data):
    """The checkpoint's buffers are the training data's statistics at its weights, and
    the test accuracy/loss rank 0 reported are those of exactly these weights+buffers."""
    from mpitrain import models
    from mpitrain.models.replica import Replica, init_tensorflow

    init_tensorflow(1, 0)
    weights, buffers = checkpoint(run_dir)
    replica = Replica(models.get(BN_MODEL_SPEC), SHAPE, CLASSES, "sgd", 0.1, applies=False)
    assert buffers.shape == (replica.n_buffers,) == (48,)
    replica.set_weights(weights)
    replica.set_buffers(buffers)
    with np.load(data) as f:
        x_train, x_test, y_test = f["x_train"][:1200], f["x_test"], f["y_test"]
    conv = replica.model.layers[0](x_train).numpy().reshape(-1, 8)  # what BN 1 normalises
    mean, var = conv.mean(axis=0), conv.var(axis=0)
    assert np.all(np.abs(buffers[:8] - mean) < 0.15 * np.sqrt(var)), (buffers[:8], mean)
    np.testing.assert_allclose(buffers[8:16], var, rtol=0.2)
    loss, accuracy = replica.evaluate(x_test, y_test.astype(np.int32))
    assert float(row["test_accuracy"]) == pytest.approx(accuracy, abs=1e-9)
    assert float(row["test_loss"]) == pytest.approx(loss, rel=1e-5)
    return accuracy


@pytest.fixture(scope="module")
def two_epoch_runs(bn_data, tmp_path_factory):
    """{mode: (run directory, runs.csv row)}: a 2-epoch sync and async run, and an async
    one with two parameter servers (--servers 2: the statistics travel to rank 0), one
    launch."""
    common = [BN_MODEL_SPEC, "--data", bn_data, "--batch-size", "32", "--epochs", "2", "--quiet"]
    found = named_runs_in_one_launch(3, {"sync": common, "async": [*common, "--async"],
                                         "async-servers": [*common, "--async", "--servers",
                                                           "2"]},
                                     tmp_path_factory.mktemp("bn-runs"))
    for mode, (_, row) in found.items():
        assert row["status"] == "ok" and row["mode"] == mode.split("-")[0], row
    return found


@pytest.mark.parametrize("mode", ["sync", "async", "async-servers"])
def test_batchnorm_statistics_are_kept_and_evaluated(bn_data, two_epoch_runs, mode):
    run_dir, row = two_epoch_runs[mode]
    accuracy = check_statistics(run_dir, row, bn_data)
    assert accuracy > 0.9  # chance: 0.25
    assert len(read_rows(run_dir / "curve.csv")) == 3  # initial + 2 epochs (sync: each
    # checked the workers' weight+buffer checksums, else the run fails with ReplicaDrift)


RESUME_EPOCHS = 24


@pytest.mark.slow
def test_stopped_sync_run_resumes_bit_exact(bn_data, tmp_path):
    """SIGUSR1 to mpirun mid-epoch, --resume: the same final weights, bit for bit, as a
    run never stopped (Dropout's seeds continue from the checkpoint too). The statistics
    match bit for bit here as well, but only because the stop comes hundreds of steps
    before the end: the workers average them at the stop step, which an uninterrupted run
    does not, and that changes them only by rounding, which momentum 0.9 forgets within
    ~160 steps. A stop nearer the end leaves them equal to rounding, not bit for bit."""
    straight, _ = train(3, bn_data, tmp_path / "straight", "--epochs", str(RESUME_EPOCHS))
    results = tmp_path / "stopped"
    cmd = ["mpirun", "-np", "3", "-hostfile", LOCAL_HOSTFILE, sys.executable, "-m",
           "mpitrain", BN_MODEL_SPEC, "--data", bn_data, "--batch-size", "32",
           "--epochs", str(RESUME_EPOCHS), "--results-dir", results, "--quiet"]
    job = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and job.poll() is None:
            curves = list(results.glob("*/curve.csv"))
            if curves and len(read_rows(curves[0])) >= 4:
                break
            time.sleep(0.05)
        assert job.poll() is None, "finished before it could be stopped: " + job.stdout.read()
        os.kill(job.pid, signal.SIGUSR1)
        out, _ = job.communicate(timeout=120)
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    assert job.returncode == 143, out
    run_dir = curves[0].parent
    stopped = read_rows(results / "runs.csv")[-1]
    assert stopped["status"] == "interrupted"
    assert 0 < int(stopped["steps"]) < 38 * RESUME_EPOCHS
    again = mpirun(3, BN_MODEL_SPEC, "--resume", run_dir, "--quiet", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_rows(results / "runs.csv")[-1]["status"] == "ok"
    (w_straight, b_straight), (w_resumed, b_resumed) = checkpoint(straight), checkpoint(run_dir)
    assert np.array_equal(w_resumed, w_straight)
    assert np.array_equal(b_resumed, b_straight)


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory):
    x, y = learnable_images(1200, 3, size=16, channels=3, classes=4)
    xt, yt = learnable_images(400, 4, size=16, channels=3, classes=4)
    path = tmp_path_factory.mktemp("colour") / "images.npz"
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
    return path


@pytest.mark.slow
def test_resnet_trains(colour_data, tmp_path):
    """At -np 2 (one worker); BatchNorm across two workers: the tests above; resnet
    at -np 3, sync and async: test_your_model's CIFAR-10 test."""
    result = mpirun(2, "resnet", "--data", colour_data, "--steps", "30", "--batch-size", "32",
                    "--results-dir", tmp_path, "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = read_rows(tmp_path / "runs.csv")[-1]
    assert (row["model"], row["mode"], row["status"]) == ("resnet", "sync", "ok")
    print(row["test_accuracy"], row["test_loss"])
    assert float(row["test_accuracy"]) > 0.5  # chance: 0.25
    with np.load(tmp_path / row["run"] / "checkpoint.npz") as f:
        assert f["weights"].shape == (272474 - 65 * 10 + 65 * 4,)  # 4 classes, not 10
        assert f["buffers"].shape == (1568,)
