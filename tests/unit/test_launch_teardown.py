"""``mpitrain launch`` bounds mpirun's exit once the run has ended by its own word
(status.json): the pure logic, then the launcher's supervision of a real process that
writes a status and then never exits.

(Not tests/unit/test_launch.py: tests/e2e/test_launch.py has that module name.)"""

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from mpitrain import launch
from mpitrain.launch import (Job, Launcher, RunWatch, attempts_run_dir, describe,
                             read_json_object, run_ended, teardown_overdue)

#: a process id no process can have (above Linux's largest pid_max, 2**22)
NO_SUCH_PID = 2 ** 22 + 1


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def new_run(results: Path, name: str, pids) -> Path:
    """A run directory as rank 0 starts it: config.json naming its ranks' pids."""
    run_dir = results / name
    write_json(run_dir / "config.json", {"ranks": [{"pid": pid} for pid in pids]})
    return run_dir


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# --- the pure logic ---------------------------------------------------------------

def test_a_status_file_that_is_missing_partial_or_not_an_object_reads_as_none(tmp_path):
    path = tmp_path / "status.json"
    assert read_json_object(path) is None
    for text in ('{"status": "fail', "[1, 2]", "", "null"):
        path.write_text(text)
        assert read_json_object(path) is None, text
    path.write_bytes(b'{"status": "\xff"}')  # not UTF-8
    assert read_json_object(path) is None
    path.write_text('{"status": "failed", "reason": "x"}')
    assert read_json_object(path) == {"status": "failed", "reason": "x"}


@pytest.mark.parametrize("status,ended", [
    ({"status": "ok"}, True), ({"status": "failed", "reason": "r"}, True),
    ({"status": "interrupted"}, True), ({"status": "running"}, False), (None, False),
    ({}, False), ({"status": ["failed"]}, False), ({"status": "FAILED"}, False)])
def test_only_ok_failed_and_interrupted_are_ends(status, ended):
    assert run_ended(status) is ended


def test_the_teardown_is_overdue_only_once_the_run_ended_a_grace_ago():
    assert not teardown_overdue(None, 1e9, 15.0)  # not ended: never
    assert not teardown_overdue(100.0, 114.9, 15.0)
    assert teardown_overdue(100.0, 115.0, 15.0)


def test_a_status_is_described_on_one_line():
    assert describe({"status": "ok", "reason": ""}) == "ok"
    assert describe({"status": "failed", "reason": "\nrank 2 on node2 silent for 60 s\n  at "
                     "step 410\n"}) == "failed: rank 2 on node2 silent for 60 s"


def test_a_resumed_runs_status_from_the_attempt_before_does_not_count(tmp_path):
    run_dir = tmp_path / "run"
    write_json(run_dir / "status.json", {"status": "failed", "reason": "the attempt before"})
    clock = Clock()
    watch = RunWatch(tmp_path, run_dir, clock)
    watch.poll(os.getpid())
    assert watch.ended_at is None and not watch.overdue(0.0)

    write_json(run_dir / "status.json", {"status": "running"})
    watch.poll(os.getpid())
    assert watch.status == {"status": "running"} and watch.ended_at is None

    write_json(run_dir / "status.json", {"status": "failed", "reason": "rank 3 lost"})
    clock.now = 200.0
    watch.poll(os.getpid())
    assert watch.ended_at == 200.0 and watch.status["reason"] == "rank 3 lost"
    clock.now = 214.0
    assert not watch.overdue(15.0)
    clock.now = 215.0
    assert watch.overdue(15.0)


def test_a_status_file_caught_unreadable_is_read_again_at_the_next_poll(tmp_path):
    run_dir = tmp_path / "run"
    path = run_dir / "status.json"
    path.parent.mkdir()
    path.write_text('{"status": "fai')
    watch = RunWatch(tmp_path, run_dir, Clock())
    path.write_text('{"status": "fai"')  # a new version, still not JSON
    watch.poll(os.getpid())
    assert watch.status is None and watch.ended_at is None
    os.truncate(path, 0)
    with open(path, "w") as f:  # the same inode, rewritten
        f.write('{"status": "failed"}')
    watch.poll(os.getpid())
    assert watch.ended_at is not None


def test_a_first_attempts_run_directory_is_the_new_one_naming_a_rank_of_the_job(tmp_path):
    results = tmp_path / "results"
    old = new_run(results, "20260101-000000-lr-sync-np4", [NO_SUCH_PID])
    write_json(old / "status.json", {"status": "failed"})
    watch = RunWatch(results, None, Clock())
    watch.poll(os.getpid())
    assert watch.run_dir is None  # the old run is not this attempt's

    # another run sharing the results directory, its rank a process here but not ours
    other = new_run(results, "20260101-000100-lr-sync-np4", [os.getppid()])
    write_json(other / "status.json", {"status": "failed"})
    watch.poll(os.getpid())
    assert watch.run_dir is None and watch.ended_at is None

    ours = new_run(results, "20260101-000001-lr-sync-np4", [NO_SUCH_PID, os.getpid()])
    watch.poll(os.getpid())
    assert watch.run_dir == ours and watch.ended_at is None  # no status.json yet
    write_json(ours / "status.json", {"status": "failed"})
    watch.poll(os.getpid())
    assert watch.ended_at is not None


def test_with_rank_0_on_another_host_the_only_new_run_directory_is_the_attempts(tmp_path):
    remote = new_run(tmp_path, "a", [NO_SUCH_PID])
    assert attempts_run_dir([remote], {os.getpid()}) == remote
    local_other = new_run(tmp_path, "b", [os.getppid()])  # a process here, not the job's
    assert attempts_run_dir([local_other], {os.getpid()}) is None
    assert attempts_run_dir([remote, new_run(tmp_path, "c", [NO_SUCH_PID])], set()) is None
    unreadable = tmp_path / "d"
    (unreadable / "config.json").parent.mkdir()
    (unreadable / "config.json").write_text("{")
    assert attempts_run_dir([unreadable], {os.getpid()}) == unreadable  # no rank here


# --- the launcher's supervision of a real process ---------------------------------

#: stands in for mpirun: writes a run directory, a status that says the run ended, then
#: ignores SIGTERM and SIGUSR1 and sleeps (60 s: "forever", yet no process outlives a
#: test). With --resume (a restart) it only touches status.json after STALE_S seconds.
FAKE_MPIRUN = r"""
import json, os, signal, sys, time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
results, status, stale_s = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
(results / "pids").mkdir(parents=True, exist_ok=True)
(results / "pids" / str(os.getpid())).touch()
if "--resume" in sys.argv:
    run = Path(sys.argv[sys.argv.index("--resume") + 1])
    time.sleep(stale_s)  # the attempt before's status.json is all there is meanwhile
    (run / "status.json").write_text(json.dumps({"status": "ok", "reason": ""}))
    sys.exit(0)
run = results / "20260101-000000-fake"
run.mkdir()
(run / "config.json").write_text(json.dumps({"ranks": [{"pid": os.getpid()}]}))
(run / "checkpoint.npz").touch()
reason = "" if status == "ok" else "rank 2 on node2 silent for 60 s"
(run / "status.json").write_text(json.dumps({"status": status, "reason": reason}))
time.sleep(60)
"""

GRACE = 0.5


@pytest.fixture
def fast_teardown(monkeypatch):
    monkeypatch.setattr(launch, "TEARDOWN_GRACE", GRACE)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)


def launcher(results: Path, status: str, max_restarts: int, stale_s: float = 0.0):
    job = Job(1, None, None, False, [], async_mode=False)
    job.command = lambda: [sys.executable, "-c", FAKE_MPIRUN]
    return Launcher(job, [str(results), status, str(stale_s)], results, None, max_restarts)


def killed_lines(err: str) -> list:
    return [line for line in err.splitlines() if "but mpirun did not exit" in line]


def assert_all_gone(results: Path):
    for pid in (results / "pids").iterdir():
        assert not psutil.pid_exists(int(pid.name)), f"fake mpirun {pid.name} still runs"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status,code", [("failed", 1), ("interrupted", 143), ("ok", 0)])
def test_mpirun_outliving_the_runs_end_is_killed_after_the_grace(tmp_path, capsys,
                                                                 fast_teardown, status, code):
    """The run says it ended; mpirun ignores SIGTERM and sleeps on: the launcher kills
    it a grace later, says so in one line, and goes on as if mpirun had exited so (no
    restarts left here: failed gives up with 1)."""
    results = tmp_path / "results"
    started = time.monotonic()
    assert launcher(results, status, max_restarts=0).run() == code
    assert time.monotonic() - started < 20  # the grace, the polls, Python's start-up
    err = capsys.readouterr().err
    reason = "" if status == "ok" else ": rank 2 on node2 silent for 60 s"
    assert killed_lines(err) == [f"mpitrain launch: the run ended ({status}{reason}) but "
                                 f"mpirun did not exit within {GRACE:g} s; killing it"]
    assert_all_gone(results)


@pytest.mark.timeout(60)
def test_the_killed_attempt_is_restarted_and_its_stale_status_spares_the_next(tmp_path,
                                                                             capsys,
                                                                             fast_teardown):
    """A failed run whose mpirun hangs is killed and restarted from its checkpoint; the
    restart, whose run directory still holds the failed status for longer than the
    grace, is not killed for it and finishes."""
    results = tmp_path / "results"
    assert launcher(results, "failed", max_restarts=1, stale_s=6 * GRACE).run() == 0
    err = capsys.readouterr().err
    assert len(killed_lines(err)) == 1, err
    assert "the job failed (exit 1); restarting from the checkpoint in " in err
    assert "the run finished after 1 restart(s)" in err
    assert_all_gone(results)
