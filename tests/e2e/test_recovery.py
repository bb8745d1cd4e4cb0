"""Async training survives a lost worker under ``mpirun --enable-recovery``: real
mpirun, real SIGKILL / SIGSTOP of a real worker rank, accuracy on real MNIST."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (LOCAL_HOSTFILE, check_went_on_without, dies_in_startup_cmd,
                      finish_bounded, mnist_dir, mpirun_cmd, rows_so_far, run_bounded,
                      start_bounded)

pytestmark = pytest.mark.slow

# LR async at -np 4 (3 workers) in batches of 5: ~1,300 steps an epoch, 1.2-1.5 s of
# it on the Xeon, so a worker lost after the first epoch is dropped (after 1 s of
# silence) while the others still train for about 4 s. (With a 3 s floor the others
# once finished first: the victim was dropped at update 12054 of 16008 with nobody
# left to take its steps.)
TRAINING = ["lr", "--async", "--epochs", "4", "--batch-size", "5", "--lr", "0.05",
            "--liveness-floor", "1", "--quiet"]
# how far two runs' final accuracies may lie apart. Async SGD in batches of 5 ends
# where its last noisy steps leave it: eleven uninterrupted runs of TRAINING gave
# 90.86-91.67% (sd 0.27 pp), and CI once saw 91.82 against a faulted run's 90.44.
# 2 pp is over 4 sd of a difference, and still fails a run that learned visibly
# worse than an uninterrupted one.
ACCURACY_SPREAD = 0.02


def start(results: Path, mnist: Path, *mpirun_flags, training=()) -> subprocess.Popen:
    return start_bounded(mpirun_cmd(4, *TRAINING, *training, "--data-dir", mnist,
                                    "--results-dir", results, flags=mpirun_flags))


def run_dir(results: Path, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in results.glob("*-lr-*") if (p / "config.json").is_file()]
        if found:
            return found[0]
        time.sleep(0.2)
    pytest.fail("no run directory appeared")


def wait_for_epoch(directory: Path, epoch: int, timeout: float = 180) -> None:
    """Until curve.csv has the evaluation after ``epoch``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(float(r["epoch"]) >= epoch for r in rows_so_far(directory / "curve.csv")):
            return
        time.sleep(0.2)
    pytest.fail(f"epoch {epoch} was not reached in {timeout} s")


def lost_ranks(directory: Path) -> list:
    try:
        status = json.loads((directory / "status.json").read_text())
    except (OSError, ValueError):
        return []
    return [w["rank"] for w in status.get("lost_workers", [])]


def rank_pid(directory: Path, rank: int) -> int:
    return json.loads((directory / "config.json").read_text())["ranks"][rank]["pid"]


def last_run(results: Path) -> dict:
    return list(csv.DictReader((results / "runs.csv").open()))[-1]


def alive(pids) -> list:
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, uninterrupted, with --enable-recovery as well."""
    results = tmp_path_factory.mktemp("reference")
    done = finish_bounded(start(results, mnist_dir(), "--enable-recovery"), 300)
    assert done.returncode == 0, done.stderr
    row = last_run(results)
    assert row["lost_workers"] == "" and row["updates_short"] == "0"
    return row


def fault_after_epoch(results: Path, mnist: Path, rank: int, sig, epoch=1, training=()):
    """Run the job under --enable-recovery, send ``sig`` to ``rank`` once ``epoch`` is
    evaluated; (completed process, run directory, the victim's pid)."""
    proc = start(results, mnist, "--enable-recovery", training=training)
    directory = run_dir(results)
    wait_for_epoch(directory, epoch)
    victim = rank_pid(directory, rank)
    os.kill(victim, sig)
    return finish_bounded(proc, 300), directory, victim


def test_a_killed_worker_is_dropped_and_the_run_finishes(tmp_path, mnist, reference):
    done, directory, _ = fault_after_epoch(tmp_path, mnist, 2, signal.SIGKILL)
    assert done.returncode == 0, done.stderr
    row = last_run(tmp_path)
    assert row["status"] == "ok"
    assert "rank 2" in row["lost_workers"] and "its process died" in row["lost_workers"]
    # its remaining steps went to the others: the planned number of updates was made
    assert int(row["steps"]) == int(reference["steps"])
    assert row["updates_short"] == "0"
    assert abs(float(row["test_accuracy"]) - float(reference["test_accuracy"])) <= ACCURACY_SPREAD
    status = json.loads((directory / "status.json").read_text())
    assert status["status"] == "ok"
    [lost] = status["lost_workers"]
    assert lost["rank"] == 2 and 0 < lost["update"] < int(reference["steps"])
    assert "lost rank 2" in done.stdout and "training continues with 2 worker(s)" in done.stdout
    # every rank's telemetry but the lost one's
    ranks = {r["rank"] for r in csv.DictReader((directory / "timing.csv").open())}
    assert ranks == {"0", "1", "3"}
    assert alive(rank_pid(directory, r) for r in range(4)) == []


def test_a_worker_lost_during_start_up_is_left_out(tmp_path):
    """Issue 53 item 1: a worker that dies before its first push (here in the trainer's
    own start-up, after rank 0 opened the run directory) ended the job. The others agree
    on the loss with rank 0, start again without it and train every planned step, in
    the directory already opened."""
    launcher = ["mpirun", "-q", "--enable-recovery", "-np", "4", "-hostfile", LOCAL_HOSTFILE]
    done = run_bounded(dies_in_startup_cmd(launcher, sys.executable, "mailboxes", 2, tmp_path),
                       300)
    row = check_went_on_without(done, tmp_path, lost=2, ranks=3)
    assert row["run"].endswith("-np4")  # the directory the first start-up opened


def test_a_stalled_worker_is_dropped_and_leaves_when_it_wakes(tmp_path, mnist, reference):
    """Through ``mpitrain launch`` (which adds --enable-recovery to async jobs), with no
    restarts allowed: the run must finish in its one job."""
    proc = start_bounded([sys.executable, "-m", "mpitrain", "launch", "-np", "4",
                          "-hostfile", LOCAL_HOSTFILE, "--max-restarts", "0", *TRAINING,
                          # dropped 1 s into its stall, not 3: the others must still be
                          # training to take over its steps, and on a fast machine they
                          # finished theirs ~3.7 s after epoch 1 (a CI run lost that race)
                          "--liveness-floor", "1",
                          "--data-dir", mnist, "--results-dir", tmp_path])
    directory = run_dir(tmp_path)
    wait_for_epoch(directory, 1)
    victim = rank_pid(directory, 3)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    # past the liveness floor, then it wakes up to its dismissal
    while 3 not in lost_ranks(directory):
        assert time.monotonic() - stopped < 60, "the stalled worker was never dropped"
        time.sleep(0.2)
    os.kill(victim, signal.SIGCONT)
    done = finish_bounded(proc, 300)
    assert done.returncode == 0, done.stderr
    row = last_run(tmp_path)
    assert row["status"] == "ok" and "silent for" in row["lost_workers"]
    assert int(row["steps"]) == int(reference["steps"])
    assert abs(float(row["test_accuracy"]) - float(reference["test_accuracy"])) <= ACCURACY_SPREAD
    assert "rank 3 on" in done.stderr and "was dropped by the parameter server" in done.stderr
    assert "restart" not in done.stderr.lower()
    assert alive(rank_pid(directory, r) for r in range(4)) == []


def test_a_worker_stopped_for_good_after_the_others_finished(tmp_path, mnist, reference):
    """A worker SIGSTOPped after epoch 2 of 4 is dropped only after the others finished
    their own steps (a liveness floor of 45 s; they need a few seconds here, a dozen
    under load, and once more than 20 under the whole suite on a slow host): they stayed, parked, and take its remaining steps, so the run makes
    its planned updates (#39: it ended short with exit 0). A stopped worker never woken
    would keep mpirun waiting: the server kills it 5 s after dropping it. The workers do
    not pipeline (as under --staleness, or when their steps are long): such a worker
    takes the reply to its FINAL push in its step loop, and once took PARKED there for
    its end and left (then "every worker was lost" when the steps came to it). (Stopped
    after epoch 3, the victim had once, under load, already finished its own shard: it
    was parked, so nobody was lost.)"""
    done, directory, victim = fault_after_epoch(tmp_path, mnist, 1, signal.SIGSTOP, epoch=2,
                                                training=("--liveness-floor", "45",
                                                          "--pipeline", "off"))
    assert done.returncode == 0, done.stderr
    assert "killed lost rank 1 on" in done.stdout and "still alive 5 s after" in done.stdout
    assert "2 of them had finished their own steps and waited" in done.stdout, done.stdout
    row = last_run(tmp_path)
    assert row["status"] == "ok" and row["updates_short"] == "0"
    assert "rank 1" in row["lost_workers"] and int(row["steps"]) == int(reference["steps"])
    assert abs(float(row["test_accuracy"]) - float(reference["test_accuracy"])) <= ACCURACY_SPREAD
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie"


def test_a_parked_worker_stopped_at_the_end_is_fenced(tmp_path, mnist, reference):
    """A worker that finished its own shard waits, parked, for the others (no lease, so
    no liveness check covers it); SIGSTOPped there, it could neither take its last
    reply nor leave, and the telemetry's gather waited for it (before: for --timeout,
    then the finished run failed, "rank 1 ... is stalled or dead"). The server, at the run's end,
    finds it stopped, waits 5 s, and counts it lost and kills it: the run is whole.
    Made so: ranks 2 and 3 are stopped after epoch 1 (a liveness floor of 60 s keeps
    them), rank 1 trains its shard alone and parks (its CPU goes quiet); then rank 1 is
    stopped and the others continued."""
    proc = start(tmp_path, mnist, "--enable-recovery",
                 training=("--liveness-floor", "60", "--timeout", "90", "--pipeline", "off"))
    directory = run_dir(tmp_path)
    wait_for_epoch(directory, 1)
    victim, others = rank_pid(directory, 1), [rank_pid(directory, r) for r in (2, 3)]
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    victim_process, deadline = psutil.Process(victim), time.monotonic() + 120
    busy, quiet = sum(victim_process.cpu_times()[:2]), 0
    while quiet < 3:  # until rank 1 is parked: asleep, waiting for the server's word (a
        assert time.monotonic() < deadline, "rank 1 never parked"  # training rank, even
        time.sleep(0.5)  # starved on a loaded host, gets more than 4% of a core)
        now = sum(victim_process.cpu_times()[:2])
        quiet, busy = (quiet + 1 if now - busy < 0.02 else 0), now
    os.kill(victim, signal.SIGSTOP)
    for pid in others:
        os.kill(pid, signal.SIGCONT)
    done = finish_bounded(proc, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lost rank 1 on" in done.stdout and "it had made its steps" in done.stdout
    assert re.search(r"killed lost rank 1 on \S+ \(pid \d+\): stopped as the run ended, still "
                     r"stopped 5 s later", done.stdout), done.stdout
    row = last_run(tmp_path)
    assert row["status"] == "ok" and row["updates_short"] == "0", row
    assert "rank 1" in row["lost_workers"] and int(row["steps"]) == int(reference["steps"])
    assert abs(float(row["test_accuracy"]) - float(reference["test_accuracy"])) <= ACCURACY_SPREAD
    assert alive(rank_pid(directory, r) for r in range(4)) == []
