"""Faults with real processes and real signals: nothing hangs, nothing is lost.

A dead rank (SIGKILL), a stalled rank (SIGSTOP), a stop request (SIGTERM to the
ranks as SLURM's srun delivers it, SIGUSR1 to mpirun as our job scripts
forward it), and a diverging run. Every launch is bounded; after each test no
process of the run may remain.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import (LOCAL_HOSTFILE, mnist_dir, mnist_shard, mpi_env, mpirun, read_rows,
                      rows_so_far, status_once_ended)
from mpitrain.results import lost_run

pytestmark = pytest.mark.slow


class Job:
    """A training job under mpirun (no -q: mpirun names a rank that dies)."""

    def __init__(self, np_, results, *args, timeout=5, epochs=400):
        self.results = Path(results)
        cmd = ["mpirun", "-np", str(np_), "-hostfile", str(LOCAL_HOSTFILE), sys.executable,
               "-m", "mpitrain", "lr", *args, "--results-dir", str(self.results), "--epochs",
               str(epochs), "--timeout", str(timeout), "--quiet"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=mpi_env(), start_new_session=True)

    def run_dir(self) -> Path:
        dirs = [d for d in self.results.iterdir() if d.is_dir()]
        return dirs[0] if dirs else None

    def wait_for_evaluations(self, rows: int, bound: float = 180) -> None:
        """Until curve.csv has ``rows`` data rows (training is well under way)."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            run = self.run_dir() if self.results.exists() else None
            if run and len(rows_so_far(run / "curve.csv")) >= rows:
                return
            assert self.proc.poll() is None, self.proc.stdout.read()
            time.sleep(0.2)
        self.kill()
        pytest.fail("training did not get going")

    def pid(self, rank: int) -> int:
        for process in psutil.process_iter(["cmdline", "environ"]):
            cmdline, environ = process.info["cmdline"] or [], process.info["environ"] or {}
            if str(self.results) in cmdline and " -m mpitrain " in f" {' '.join(cmdline)} " \
                    and environ.get("OMPI_COMM_WORLD_RANK") == str(rank):
                return process.pid
        raise AssertionError(f"rank {rank} not found")

    def signal_every_rank(self, ranks: int, signum: int) -> None:
        """Signal ranks 0..ranks-1 as srun does: all pids found first, since a rank
        signalled may end the others before they are looked up."""
        for pid in [self.pid(rank) for rank in range(ranks)]:
            with contextlib.suppress(ProcessLookupError):  # it ended since: as if signalled
                os.kill(pid, signum)

    def finish(self, bound: float) -> tuple:
        """(exit code, output, seconds); fails the test if the job outlives ``bound``."""
        t0 = time.monotonic()
        try:
            out, _ = self.proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"job still running {bound} s after the fault (a hang)")
        return self.proc.returncode, out, time.monotonic() - t0

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        for rank in range(8):
            try:
                os.kill(self.pid(rank), signal.SIGKILL)
            except (AssertionError, OSError):
                pass

    def assert_no_leftovers(self) -> None:
        time.sleep(0.5)
        left = []
        for rank in range(8):
            try:
                left.append(self.pid(rank))
            except AssertionError:
                pass
        assert not left, f"processes left behind: {left}"


def check_results_readable(run_dir: Path) -> None:
    assert len(read_rows(run_dir / "curve.csv")) >= 2
    with np.load(run_dir / "checkpoint.npz") as ckpt:
        assert ckpt["weights"].shape == (7850,)
    json.loads((run_dir / "config.json").read_text())


@pytest.mark.parametrize("mode,rank", [("sync", 2), ("async", 2), ("sync", 0), ("async", 0)])
def test_killed_rank_ends_the_job(mnist, tmp_path, mode, rank):
    extra = ("--async",) if mode == "async" else ()
    job = Job(3, tmp_path, "--data-dir", str(mnist), *extra, timeout=20)
    job.wait_for_evaluations(3)
    os.kill(job.pid(rank), signal.SIGKILL)
    code, out, seconds = job.finish(bound=20 + 10)
    assert code != 0
    assert f"process rank {rank}" in out and "signal 9" in out, out
    check_results_readable(job.run_dir())
    # recorded: by rank 0 if it saw the loss before mpirun killed it, else by its witness
    status = status_once_ended(job.run_dir())
    assert (status["status"], status.get("runs_csv")) == ("failed", "written"), status
    if rank == 0:
        assert status["reason"] == lost_run.REASON
    assert [row["status"] for row in read_rows(tmp_path / "runs.csv")] == ["failed"]
    job.assert_no_leftovers()


@pytest.mark.parametrize("extra", [
    # the other worker polls the allreduce (auto's pick where the workers outnumber
    # the cores, or other processes keep them busy)
    ("--allreduce-wait", "poll"), ("--async",),
    # the other worker waits inside MPI's blocking allreduce, its heartbeats sent by
    # the watchdog thread (auto's pick where every worker has a core)
    ("--allreduce-wait", "spin"),
    # the other worker waits in the barriers of the sum through shared memory
    ("--shared-memory", "on")], ids=["sync", "async", "sync-spin", "sync-shared"])
def test_stalled_worker_is_named_by_the_watchdog(mnist, tmp_path, extra):
    # Spinning workers keep both cores to themselves, and rank 0 (the sync server, at
    # nice 19) takes the reports and evaluates with what is left: on a host the rest of
    # the suite also loads, worker 1 once waited more than 4 s for it to take a report's
    # weights, before any rank was stopped. A longer bound there; the same check.
    timeout = 10 if "spin" in extra else 4
    job = Job(3, tmp_path, "--data-dir", str(mnist), *extra, timeout=timeout)
    job.wait_for_evaluations(3)
    victim = job.pid(2)
    os.kill(victim, signal.SIGSTOP)
    try:
        code, out, seconds = job.finish(bound=timeout + 20)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(victim).resume()
    assert code != 0
    lines = [l for l in out.splitlines() if l.startswith("mpitrain: error")]
    assert lines and "rank 2 on" in lines[0] and "stalled or dead" in lines[0], out
    run = read_rows(tmp_path / "runs.csv")[-1]
    assert run["status"] == "failed" and "rank 2 on" in run["reason"]
    status = json.loads((job.run_dir() / "status.json").read_text())
    assert status["status"] == "failed"
    check_results_readable(job.run_dir())
    job.assert_no_leftovers()


def test_a_silent_sync_worker_is_named_at_its_liveness_bound_long_before_the_timeout(
        mnist, tmp_path):
    # what a host lost without closing its connections looks like to rank 0: a worker
    # that says nothing; the others wait in the allreduce, which --timeout bounds
    job = Job(3, tmp_path, "--data-dir", str(mnist), "--liveness-floor", "1", timeout=120)
    job.wait_for_evaluations(3)
    victim = job.pid(2)
    os.kill(victim, signal.SIGSTOP)
    try:
        code, out, seconds = job.finish(bound=60)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(victim).resume()
    assert code != 0 and seconds < 60  # (the 120 s timeout would fail the bound above)
    lines = [l for l in out.splitlines() if l.startswith("mpitrain: error")]
    assert lines and "rank 2 on" in lines[0] and "past its liveness bound" in lines[0], out
    assert read_rows(tmp_path / "runs.csv")[-1]["status"] == "failed"
    check_results_readable(job.run_dir())
    job.assert_no_leftovers()


def final_weights(run_dir: Path) -> np.ndarray:
    with np.load(run_dir / "checkpoint.npz") as ckpt:
        return ckpt["weights"].copy()


RESUME_EPOCHS = 15  # long enough to stop mid-run after 4 evaluations


@pytest.fixture(scope="module")
def uninterrupted_weights(tmp_path_factory):
    """Final weights of an uninterrupted sync LR run (the resume tests' reference)."""
    results = tmp_path_factory.mktemp("straight")
    straight = mpirun(3, "lr", "--data-dir", mnist_dir(), "--results-dir", results,
                      "--epochs", str(RESUME_EPOCHS), "--quiet", timeout=600)
    assert straight.returncode == 0, straight.stderr[-2000:]
    return final_weights(next(d for d in results.iterdir() if d.is_dir()))


@pytest.mark.parametrize("how", ["SIGTERM to every rank", "SIGUSR1 to mpirun"])
def test_stop_checkpoint_and_bit_exact_resume_sync(mnist, tmp_path, how, uninterrupted_weights):
    epochs = RESUME_EPOCHS
    job = Job(3, tmp_path / "a", "--data-dir", str(mnist), epochs=epochs)
    job.wait_for_evaluations(4)
    if how.startswith("SIGTERM"):
        job.signal_every_rank(3, signal.SIGTERM)
    else:
        os.kill(job.proc.pid, signal.SIGUSR1)
    code, out, _ = job.finish(bound=60)
    assert code == 143, out
    assert "mpitrain: interrupted: stopped by SIG" in out
    run_dir = job.run_dir()
    stopped = read_rows(tmp_path / "a" / "runs.csv")[-1]
    per_epoch = -(-mnist_shard(2) // 100)  # steps: 2 workers, the default batch of 100
    assert stopped["status"] == "interrupted" and 0 < int(stopped["steps"]) < per_epoch * epochs
    assert json.loads((run_dir / "status.json").read_text())["status"] == "interrupted"
    job.assert_no_leftovers()

    resumed = mpirun(3, "lr", "--resume", run_dir, "--quiet", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_rows(tmp_path / "a" / "runs.csv")
    assert [r["status"] for r in rows] == ["interrupted", "ok"] and rows[-1]["resumed"] == "True"
    curve = read_rows(run_dir / "curve.csv")
    assert float(curve[-1]["epoch"]) == epochs
    assert [int(r["step"]) for r in curve] == sorted(int(r["step"]) for r in curve)
    assert np.array_equal(final_weights(run_dir), uninterrupted_weights)


def test_stop_and_resume_async(mnist, tmp_path):
    job = Job(3, tmp_path, "--data-dir", str(mnist), "--async", epochs=60)
    job.wait_for_evaluations(4)
    job.signal_every_rank(3, signal.SIGTERM)
    code, out, _ = job.finish(bound=60)
    assert code == 143, out
    run_dir = job.run_dir()
    stopped = read_rows(tmp_path / "runs.csv")[-1]
    assert stopped["status"] == "interrupted" and stopped["pushes"] == stopped["applied"]
    job.assert_no_leftovers()
    resumed = mpirun(3, "lr", "--resume", run_dir, "--quiet", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    done = read_rows(tmp_path / "runs.csv")[-1]
    assert done["status"] == "ok" and float(done["epochs"]) == pytest.approx(60, abs=0.05)
    assert float(done["test_accuracy"]) > 0.85
    walls = [float(r["wall_time_s"]) for r in read_rows(run_dir / "curve.csv")]
    assert walls == sorted(walls), walls  # the resumed session's clock goes on


@pytest.mark.parametrize("np_,extra", [(1, ()), (3, ()), (3, ("--async",))])
def test_divergence_is_caught(mnist, tmp_path, np_, extra):
    # lr 1e38 overflows float32 logits at the second step. (1e30 does not: logistic
    # regression's softmax saturates and the loss stays huge but finite.)
    result = mpirun(np_, "lr", "--lr", "1e38", "--epochs", "2", "--data-dir", mnist,
                    "--results-dir", tmp_path, *extra, timeout=300)
    assert result.returncode == 1
    lines = [l for l in result.stderr.splitlines() if l.startswith("mpitrain: error")]
    assert len(lines) == 1 and "training diverged: non-finite loss or gradient on" in lines[0]
    assert "step" in lines[0]
    run = read_rows(tmp_path / "runs.csv")[-1]
    assert run["status"] == "failed" and "diverged" in run["reason"]


def test_resume_refuses_incompatible_settings(mnist, tmp_path):
    first = mpirun(3, "lr", "--steps", "3", "--data-dir", mnist, "--results-dir", tmp_path,
                   "--quiet")
    assert first.returncode == 0
    run_dir = next(d for d in tmp_path.iterdir() if d.is_dir())
    for args, pattern in ((["--batch-size", "50"], "--batch-size was 100 in that run"),
                          (["--async"], "--async was False"),):
        bad = mpirun(3, "lr", "--resume", run_dir, *args, timeout=120)
        assert bad.returncode == 2 and pattern in bad.stderr, bad.stderr
    done = mpirun(3, "lr", "--resume", run_dir, timeout=120)
    assert done.returncode == 2 and "did 3 steps (0.03 epochs); --steps 3 asks for 3: pass a " \
        "larger --steps" in done.stderr, done.stderr
    # another -np is not refused: the run goes on rescaled (run.resume.Rescale), and says
    # so; here keeping each worker's batch (the global batch's rule: tests/e2e/test_netns.py)
    more = mpirun(4, "lr", "--resume", run_dir, "--steps", "5", "--elastic-batch",
                  "per-worker", timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resumed on another number of ranks, -np 3 -> 4 (2 -> 3 workers): batch 100 per " \
        "worker kept (--elastic-batch per-worker), global batch 200 -> 300, lr" \
        in more.stdout + more.stderr
    row = read_rows(tmp_path / "runs.csv")[-1]
    assert (row["np"], row["batch_size"], row["global_batch"], row["steps"]) == \
        ("4", "100", "300", "5")
    assert float(row["lr"]) == pytest.approx(float(read_rows(tmp_path / "runs.csv")[0]["lr"])
                                             * 3 / 2)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_converts_keras_optimizer_state_and_refuses_one_that_does_not_fit(
        mnist, tmp_path, mode):
    """Sync: a checkpoint of Keras' optimizer (--compile graph, and every mpitrain
    before the flat update became the default) resumes under --compile auto, its state
    converted to the flat optimizer's layout. Either mode: an optimizer state in
    neither layout is refused with one line, not a traceback."""
    from mpitrain.run.checkpoint import Checkpoint

    # (a constant rate: Keras keeps it in its state, the layout this converts)
    extra = ["--async"] if mode == "async" else ["--compile", "graph", "--lr-schedule",
                                                   "constant"]
    first = mpirun(2, "lr", *extra, "--optimizer", "momentum", "--steps", "3", "--data-dir",
                   mnist, "--results-dir", tmp_path, "--quiet")
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = next(d for d in tmp_path.iterdir() if d.is_dir())
    if mode == "sync":
        keras = Checkpoint.load(run_dir).optimizer  # count, rate, one velocity per variable
        assert [np.shape(v) for v in keras.values()] == [(), (), (784, 10), (10,)]
        flat = mpirun(2, "lr", "--resume", run_dir, "--compile", "auto", "--steps", "6",
                      "--quiet", timeout=120)
        assert flat.returncode == 0, flat.stderr[-2000:]
        state = Checkpoint.load(run_dir).optimizer
        assert [np.shape(v) for v in state.values()] == [(), (7850,)] and state["o0"] == 6
    ckpt = Checkpoint.load(run_dir)
    ckpt.optimizer["o_kernel_momentum"] = np.zeros((784, 10), np.float32)
    ckpt.save(run_dir)
    bad = mpirun(2, "lr", "--resume", run_dir, "--steps", "9", timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    lines = [l for l in bad.stderr.splitlines() if l.startswith("mpitrain: error")]
    assert len(lines) == 1 and "optimizer state" in lines[0] and "does not fit" in lines[0] \
        and "Traceback" not in bad.stderr, bad.stderr


def test_async_checkpoint_counts_worker_steps(mnist, tmp_path):
    """An async checkpoint's step counts all workers' updates: a finished 1-epoch run
    at -np 3 (2 workers) is at 2 epochs' worth of server updates, yet resumes to 2
    epochs (it was refused as finished), and is refused once it has done them. The
    resume abbreviates --epochs (it was dropped as not given); the refusal counts the
    epochs the run did, not those of its first session. The batch comes from
    --batches-per-epoch (20 steps an epoch): such a run's saved config holds both it and
    the batch, which the resume once refused as given together."""
    first = mpirun(3, "lr", "--async", "--epochs", "1", "--batches-per-epoch", "20",
                   "--data-dir", mnist, "--results-dir", tmp_path, "--quiet")
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = next(d for d in tmp_path.iterdir() if d.is_dir())
    more = mpirun(3, "lr", "--async", "--resume", run_dir, "--epoch", "2", "--quiet")
    assert more.returncode == 0, more.stderr[-2000:]
    assert float(read_rows(tmp_path / "runs.csv")[-1]["epochs"]) == pytest.approx(2, abs=0.05)
    again = mpirun(3, "lr", "--async", "--resume", run_dir, timeout=120)
    assert again.returncode == 2 and "that run already did 40 steps (2 epochs); --epochs 1 " \
        "asks for 20: pass a larger --epochs" in again.stderr, again.stderr


@pytest.mark.parametrize("extra", [(), ("--async",)])
def test_resume_of_a_run_killed_after_its_final_checkpoint_writes_its_results(
        mnist, tmp_path, extra):
    """A kill between the final checkpoint and the results (found by scripts/soak
    --launch) leaves status.json at running and no runs.csv row: resuming it trains
    nothing and writes the row from the checkpoint, with the same accuracy."""
    args = ["lr", "--epochs", "1", "--batch-size", "500", "--data-dir", mnist, "--quiet", *extra]
    first = mpirun(3, *args, "--results-dir", tmp_path / "first")
    assert first.returncode == 0, first.stderr[-2000:]
    finished = read_rows(tmp_path / "first" / "runs.csv")[-1]
    run_dir = tmp_path / "first" / finished["run"]
    (run_dir / "status.json").write_text('{"status": "running", "reason": ""}')
    (tmp_path / "first" / "runs.csv").unlink()  # as if killed before writing it
    again = mpirun(3, *args, "--resume", run_dir)
    assert again.returncode == 0, again.stderr[-2000:]
    row = read_rows(tmp_path / "first" / "runs.csv")[-1]
    assert row["status"] == "ok" and row["resumed"] == "True"
    assert float(row["test_accuracy"]) == pytest.approx(float(finished["test_accuracy"]),
                                                        abs=1e-6)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
