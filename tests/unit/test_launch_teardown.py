"""``mpitrain launch`` bounds mpirun's exit once the run has ended by its own word
(status.json), or once rank 0 is gone without a word: the pure logic, then the
launcher's supervision of a real process that writes a status and then never exits.

(Not tests/unit/test_launch.py: tests/e2e/test_launch.py has that module name.)"""

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from mpitrain.launch import job as launch
from mpitrain.launch.job import Job, Launcher
from mpitrain.launch.watch import (RunWatch, describe, is_attempts, recorded_code,
                                   teardown_overdue, writer_gone)
from mpitrain.results.run_dir import (ATTEMPT_ENV, attempt_facts, process_identity, run_ended,
                                     writer_visible)
from mpitrain.userfiles import read_json_object

def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def status(value: str, token: str, writer=None, **more) -> dict:
    """A status.json as rank 0 writes it under the launcher (the writer: this process)."""
    return {"status": value, "reason": "", "launch_attempt": token,
            "writer": writer or process_identity(), **more}


def gone_pid() -> int:
    """The pid of a process that ran here and is gone (reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


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


def test_a_status_is_the_attempts_only_with_its_token():
    assert is_attempts(status("running", "a1"), "a1")
    assert not is_attempts(status("running", "a0"), "a1")  # the attempt before, or another run
    assert not is_attempts({"status": "failed", "reason": ""}, "a1")  # not under the launcher
    assert not is_attempts(None, "a1") and not is_attempts({}, "a1")


def test_rank_0_records_the_attempts_token_and_who_writes():
    here = process_identity()
    assert here["pid"] == os.getpid() and here["boot_id"] and isinstance(here["pid_ns"], int)
    assert attempt_facts({}) == {"writer": here}  # not under the launcher: no token
    assert attempt_facts({ATTEMPT_ENV: "a1"}) == {"launch_attempt": "a1", "writer": here}


def test_a_writer_is_visible_only_from_the_same_boot_and_pid_namespace():
    here = process_identity()
    assert writer_visible(dict(here), here)
    assert writer_visible({**here, "pid": 1}, here)
    assert not writer_visible({**here, "boot_id": "another-boot"}, here)  # another host
    assert not writer_visible({**here, "pid_ns": here["pid_ns"] + 1}, here)  # a container
    assert not writer_visible({**here, "pid": "12"}, here)
    for broken in (None, "x", {}, {"pid": os.getpid()}):
        assert not writer_visible(broken, here), broken
    unknown = {**here, "boot_id": None}  # where /proc cannot say, nothing is visible
    assert not writer_visible(unknown, unknown)


def test_a_running_writer_is_gone_when_its_visible_process_is_gone_or_a_zombie():
    here = process_identity()
    gone = {**here, "pid": gone_pid()}
    assert writer_gone(status("running", "a1", gone), here)
    assert not writer_gone(status("running", "a1"), here)  # this process: alive
    assert not writer_gone(status("running", "a1", {**gone, "boot_id": "other"}), here)
    assert not writer_gone(status("failed", "a1", gone), here)  # an end: the other bound
    assert not writer_gone({"status": "running"}, here) and not writer_gone(None, here)

    zombie = os.fork()
    if zombie == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(zombie).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert writer_gone(status("running", "a1", {**here, "pid": zombie}), here)
    finally:
        os.waitpid(zombie, 0)


def test_a_resumed_runs_status_from_the_attempt_before_does_not_count(tmp_path):
    run_dir = tmp_path / "run"
    write_json(run_dir / "status.json", status("failed", "a0", reason="the attempt before"))
    clock = Clock()
    watch = RunWatch(tmp_path, run_dir, "a1", clock)
    watch.poll()
    assert watch.run_dir is None and watch.ended_at is None and not watch.overdue(0.0)

    write_json(run_dir / "status.json", status("running", "a1"))
    watch.poll()
    assert watch.run_dir == run_dir and watch.status["status"] == "running"
    assert watch.ended_at is None and watch.gone_at is None  # its writer (we) runs

    write_json(run_dir / "status.json", status("failed", "a1", reason="rank 3 lost"))
    clock.now = 200.0
    watch.poll()
    assert watch.ended_at == 200.0 and watch.status["reason"] == "rank 3 lost"
    clock.now = 214.0
    assert not watch.overdue(15.0)
    clock.now = 215.0
    assert watch.overdue(15.0) and not watch.writer_gone_overdue(0.0)


def test_a_status_file_caught_unreadable_is_read_again_at_the_next_poll(tmp_path):
    run_dir = tmp_path / "run"
    path = run_dir / "status.json"
    path.parent.mkdir()
    path.write_text('{"status": "fai')
    watch = RunWatch(tmp_path, run_dir, "a1", Clock())
    watch.poll()
    assert watch.status is None and watch.ended_at is None
    path.write_text(json.dumps(status("failed", "a1")))
    watch.poll()
    assert watch.ended_at is not None


def test_a_first_attempts_run_directory_is_the_new_one_with_its_token(tmp_path):
    results = tmp_path / "results"
    write_json(results / "20260101-000000-lr-sync-np4" / "status.json",
               status("running", "a1"))  # there before the watch: not this attempt's
    watch = RunWatch(results, None, "a1", Clock())
    watch.poll()
    assert watch.run_dir is None

    # another run sharing the results directory, and a new run not yet running
    write_json(results / "20260101-000100-lr-sync-np4" / "status.json",
               status("failed", "other", reason="not ours"))
    (results / "20260101-000200-lr-sync-np4").mkdir()
    watch.poll()
    assert watch.run_dir is None and watch.ended_at is None

    ours = results / "20260101-000001-lr-sync-np4"
    write_json(ours / "status.json", status("running", "a1"))
    watch.poll()
    assert watch.run_dir == ours and watch.ended_at is None
    write_json(results / "20260101-000100-lr-sync-np4" / "status.json",
               status("failed", "a1"))  # the token's run is already known: not looked at
    watch.poll()
    assert watch.run_dir == ours and watch.ended_at is None
    write_json(ours / "status.json", status("failed", "a1"))
    watch.poll()
    assert watch.ended_at is not None


def test_rank_0_gone_with_its_status_running_is_overdue_a_grace_later(tmp_path):
    here = process_identity()
    run_dir = tmp_path / "run"
    clock = Clock()
    watch = RunWatch(tmp_path, run_dir, "a1", clock)
    write_json(run_dir / "status.json", status("running", "a1", {**here, "pid": gone_pid()}))
    watch.poll()
    assert watch.gone_at == 100.0 and watch.ended_at is None
    clock.now = 114.0
    watch.poll()
    assert watch.gone_at == 100.0 and not watch.writer_gone_overdue(15.0)
    clock.now = 115.0
    assert watch.writer_gone_overdue(15.0) and not watch.overdue(0.0)

    # rank 0 on another host (another boot): nothing can be told, mpirun is waited for
    remote = RunWatch(tmp_path, run_dir, "a2", clock)
    write_json(run_dir / "status.json",
               status("running", "a2", {**here, "pid": gone_pid(), "boot_id": "other"}))
    remote.poll()
    clock.now = 1e6
    assert remote.gone_at is None and not remote.writer_gone_overdue(15.0)


# --- the launcher's supervision of a real process ---------------------------------

#: stands in for mpirun: writes a run directory and a status.json as rank 0 would (the
#: token from its environment, itself as the writer) that says the run ended, then
#: ignores SIGTERM and SIGUSR1 and sleeps (60 s: "forever", yet no process outlives a
#: test). With --resume (a restart) it only writes status.json after STALE_S seconds.
#: Other statuses: rank0-gone and rank0-zombie (status running, written for a child
#: that then exits, reaped or not, its time of exit in results/rank0-exited), wrong-token
#: (a failed status for another attempt, then exit 0 after STALE_S seconds).
FAKE_MPIRUN = r"""
import json, os, signal, sys, time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
results, status, stale_s = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
token = os.environ["MPITRAIN_LAUNCH_ATTEMPT"]
(results / "pids").mkdir(parents=True, exist_ok=True)
(results / "pids" / str(os.getpid())).touch()

def write_status(run, status, reason="", token=token, pid=os.getpid()):
    with open("/proc/sys/kernel/random/boot_id") as f:
        writer = {"pid": pid, "boot_id": f.read().strip(),
                  "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    (run / "status.json").write_text(json.dumps(
        {"status": status, "reason": reason, "launch_attempt": token, "writer": writer}))

if "--resume" in sys.argv:
    run = Path(sys.argv[sys.argv.index("--resume") + 1])
    time.sleep(stale_s)  # the attempt before's status.json is all there is meanwhile
    write_status(run, "ok")
    sys.exit(0)
run = results / "20260101-000000-fake"
run.mkdir()
(run / "config.json").write_text(json.dumps({"ranks": [{"pid": os.getpid()}]}))
(run / "checkpoint.npz").touch()
if status in ("rank0-gone", "rank0-zombie"):
    rank0 = os.fork()
    if rank0 == 0:
        time.sleep(0.3)
        (results / "rank0-exited").write_text(repr(time.time()))  # no later than its end
        os._exit(0)
    write_status(run, "running", pid=rank0)
    # a zombie: waited for, not reaped
    os.waitid(os.P_PID, rank0, os.WEXITED | (os.WNOWAIT if status == "rank0-zombie" else 0))
elif status == "ok-then-exit-9":  # a rank killed after rank 0 recorded the end
    write_status(run, "ok")
    sys.exit(9)
elif status == "never-starts":  # mpirun waiting for a daemon: no rank, no status
    time.sleep(60)
elif status == "wrong-token":
    write_status(run, "failed", "another attempt's", token="not-this-attempts")
    time.sleep(stale_s)
    sys.exit(0)
else:
    reason = "" if status == "ok" else "rank 2 on node2 silent for 60 s"
    write_status(run, status, reason)
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


def test_every_rank_gets_the_attempts_token():
    command = Job(4, None, None, False, ["--bind-to", "none"], async_mode=False).command()
    x = command.index("-x")
    assert command[x + 1] == ATTEMPT_ENV and x < command.index(sys.executable)


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
def test_a_job_whose_ranks_never_start_is_killed_after_the_start_bound(tmp_path, capsys,
                                                                        monkeypatch):
    """mpirun waits for a host's daemon that never answers (seen on the emulated cluster:
    Open MPI stuck starting a restart's daemons, no rank anywhere): the launcher kills it
    once rank 0 has not said running within START_BOUND, a failure (restarted if any are
    left; none here: 1)."""
    monkeypatch.setattr(launch, "START_BOUND", 1.0)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)
    results = tmp_path / "results"
    started = time.monotonic()
    assert launcher(results, "never-starts", max_restarts=0).run() == 1
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert "mpitrain launch: the job did not start within 1 s (rank 0 never said running: " \
        "mpirun waits for a host's daemon that never answered it?); killing it" in err
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["rank0-gone", "rank0-zombie"])
def test_mpirun_outliving_rank_0_gone_without_an_end_is_killed_after_the_grace(
        tmp_path, capsys, fast_teardown, how):
    """Rank 0 wrote running and died (its process gone, or a zombie); mpirun ignores
    SIGTERM and sleeps on: the launcher kills it a grace after it saw rank 0 gone, says
    so in one line and goes on as after a failure (no restarts left: 1)."""
    results = tmp_path / "results"
    assert launcher(results, how, max_restarts=0).run() == 1
    after_exit = time.time() - float((results / "rank0-exited").read_text())
    assert GRACE <= after_exit < GRACE + 5  # the grace, the polls, a loaded host
    pid = read_json_object(results / "20260101-000000-fake" / "status.json")["writer"]["pid"]
    err = capsys.readouterr().err
    assert killed_lines(err) == [f"mpitrain launch: rank 0 (pid {pid}) is gone but mpirun "
                                 f"did not exit within {GRACE:g} s; killing it"]
    assert "the job failed (exit 1) and no restarts are left" in err
    assert_all_gone(results)


@pytest.mark.timeout(60)
def test_a_status_with_another_attempts_token_is_not_taken_for_the_attempts(
        tmp_path, capsys, fast_teardown):
    """A run directory whose status.json says failed, but for another token: mpirun is
    not killed for it, and its exit (0) without an end recorded by its own run is a
    failure (every rank died: Open MPI 5 under ULFM exits 0 so)."""
    results = tmp_path / "results"
    started = time.monotonic()
    assert launcher(results, "wrong-token", max_restarts=0, stale_s=8 * GRACE).run() == 1
    assert time.monotonic() - started >= 8 * GRACE
    err = capsys.readouterr().err
    assert killed_lines(err) == [] and "mpirun exited 0, but the run did not record" in err
    assert_all_gone(results)


@pytest.mark.timeout(60)
def test_a_finished_run_whose_mpirun_failed_after_is_not_restarted(tmp_path, capsys,
                                                                    fast_teardown):
    """The run recorded ok, then mpirun exited 9 (a rank killed as the job ended): its
    code is kept, and no restart is tried (resumed, every step done, it would be refused
    with a usage error)."""
    results = tmp_path / "results"
    assert launcher(results, "ok-then-exit-9", max_restarts=2).run() == 9
    err = capsys.readouterr().err
    assert err.count("mpitrain launch: $ ") == 1 and "restarting" not in err, err
    assert "the run ended well (status ok, its results written) but mpirun exited 9" in err
    assert_all_gone(results)


@pytest.mark.parametrize("mpirun_code,status,expected", [
    (0, None, 1),  # no end recorded: every rank died (Open MPI 5 under ULFM says 0)
    (2, None, 2),  # no run recorded: mpirun's word
    (0, "ok", 0),
    (0, "interrupted", 143),  # Open MPI 4's mpirun --enable-recovery exits 0 whatever
    (1, "interrupted", 143),  # ... or 1 when a rank ended the job through it
    (0, "failed", 1),
    (74, "failed", 74),  # mpirun's more precise code kept
    (1, "ok", 1),  # a run recorded ok keeps a failure mpirun saw after it
    (143, "running", 143),  # not ended: mpirun's word
])
def test_the_job_code_is_the_recorded_end_where_mpirun_dropped_it(mpirun_code, status,
                                                                  expected):
    recorded = None if status is None else {"status": status}
    assert recorded_code(mpirun_code, recorded) == expected
    if status is None:  # a script records nothing: mpirun's word
        assert recorded_code(mpirun_code, recorded, records=False) == mpirun_code


def test_the_attempts_processes_outside_mpiruns_session_are_killed_by_token():
    """A rank whose daemon left mpirun's session (Open MPI's orted daemonizes) is not
    reached by killing the session: kill_strays finds it by the attempt's token in its
    environment, and leaves another attempt's process alone."""
    import subprocess

    from mpitrain.launch.watch import kill_strays

    def detached(token):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env={**os.environ, ATTEMPT_ENV: token},
                                start_new_session=True)

    stray, other = detached("this-attempt"), detached("another-attempt")
    try:
        assert kill_strays("this-attempt") == 1
        assert stray.wait(timeout=10) == -9 and other.poll() is None
    finally:
        for proc in (stray, other):
            proc.kill()
            proc.wait()
