"""Hosts that are lost and come back (mpitrain.launch.membership): the bookkeeping on a
fake clock, then the launcher taking a host back with a real (fake) mpirun process:
left out after a failure, found answering while the job runs, the job stopped at a
checkpoint and restarted on it. The same on a real emulated cluster:
tests/e2e/test_netns.py."""

import json
import sys
import threading
import time

import pytest

from mpitrain.launch import command
from mpitrain.launch import job as launch
from mpitrain.launch import membership
from mpitrain.launch.changes import ChangeLog
from mpitrain.launch.hostfile import Host
from mpitrain.launch.job import Job, Launcher
from mpitrain.errors import MpitrainError, UsageError
from mpitrain.launch.discovery import HostfileSource
from mpitrain.launch.membership import MAX_COOLDOWN, Membership
from mpitrain.results.run_dir import read_csv

HOSTS = [Host("a", 2), Host("b", 1), Host("c", 1)]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_host_left_out_is_due_after_a_cooldown_that_doubles_each_loss():
    clock = Clock()
    members = Membership(HOSTS, 4, oversubscribe=False, poll=10.0, clock=clock)
    assert members.np_now() == 4 and members.cooled() == []
    lines = members.leave_out({"c": "exit 255"})
    assert [h.name for h in members.current()] == ["a", "b"] and members.np_now() == 3
    assert lines == ["host c left out (exit 255; lost 1 time(s)): probed again in 10 s, "
                     "then every 10 s while the job runs"]
    clock.now += 9.9
    assert members.cooled() == []
    clock.now += 0.1
    assert members.cooled() == ["c"]
    members.take_back(["c"])
    assert members.np_now() == 4 and members.cooled() == []
    for cooldown in (20, 40, 80, 160, 320, MAX_COOLDOWN, MAX_COOLDOWN):  # lost again...
        members.leave_out({"c": "exit 255"})
        assert members.left_out["c"].cooldown == cooldown
        members.take_back(["c"])


def test_blacklist_cooldown_range_bounds_the_doubling():
    """--blacklist-cooldown-range LOWER UPPER (Horovod's option): LOWER after the first
    loss, doubling, at most UPPER; nonsense is one usage line."""
    clock = Clock()
    members = Membership(HOSTS, 4, oversubscribe=False, poll=10.0, clock=clock,
                         cooldown=command.cooldown_range([5, 30], 10.0))
    for cooldown in (5, 10, 20, 30, 30):
        members.leave_out({"c": "exit 255"})
        assert members.left_out["c"].cooldown == cooldown
        members.take_back(["c"])
    assert command.cooldown_range(None, 0.0) == (membership.HOST_POLL, MAX_COOLDOWN)
    assert command.cooldown_range(None, 900.0) == (900.0, 900.0)
    for nonsense in ([0, 5], [10, 5], [-1, 5]):
        with pytest.raises(UsageError, match=r"^--blacklist-cooldown-range .*: give LOWER "
                           r"and UPPER seconds with 0 < LOWER <= UPPER \(e.g. 10 600\)$"):
            command.cooldown_range(nonsense, 10.0)


def test_oversubscribed_the_ranks_stay_however_few_the_hosts():
    members = Membership(HOSTS, 4, oversubscribe=True)
    members.leave_out({"b": "gone", "c": "gone"})
    assert members.np_now() == 4


def test_hosts_due_are_probed_on_a_thread_and_those_answering_reported_once():
    clock, asked = Clock(), []
    members = Membership(HOSTS, 4, oversubscribe=False, poll=5.0, clock=clock)
    members.leave_out({"b": "gone", "c": "gone"})
    answer = {"b": "still gone"}

    def probe(names):
        asked.append(list(names))
        return {name: why for name, why in answer.items() if name in names}

    assert members.look(probe) == []  # nothing due yet
    clock.now += 5.0
    assert members.look(probe) == []  # the probe started
    members._probing.join(5)
    assert members.look(probe) == ["c"] and asked == [["b", "c"]]
    assert members.look(probe) == []  # reported once; b is due a poll later
    members.take_back(["c"])
    clock.now += 5.0
    members.look(probe)
    members._probing.join(5)
    assert members.look(probe) == [] and asked[-1] == ["b"]
    assert Membership(HOSTS, 4, False, poll=0.0).look(probe) == []  # off: never probes


def test_a_changed_hostfile_adds_hosts_to_probe_and_removes_others(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=2\nb\nc\n")
    clock = Clock()
    members = Membership(HOSTS, 4, False, poll=5.0, clock=clock,
                         source=HostfileSource(str(path)))
    assert members.reread() == []  # as it was read at the launch
    members.leave_out({"c": "gone"})
    path.write_text("a slots=2\nb\nd\n")  # c replaced by d
    assert members.reread() == [
        f"{path}: host(s) d added: probed, and taken in if they answer and the job is "
        "short of slots", f"{path}: host(s) c removed: the job leaves them at its next "
        "restart"]
    assert [h.name for h in members.hosts] == ["a", "b", "d"]
    assert list(members.left_out) == ["d"] and members.cooled() == ["d"]  # due at once
    assert members.reread() == []  # read once per change
    path.write_text("a slots=x\n")
    assert members.reread()[0].startswith("the hostfile changed but cannot be read (")
    assert [h.name for h in members.hosts] == ["a", "b", "d"]


def test_the_hosts_of_lost_async_workers_are_left_out_once():
    """status.json's lost_workers (an async job that went on without them): their hosts
    are left out, each loss once (the change log picks the new ones), so that the job
    grows back when they answer; never the first host (the parameter server runs there),
    nor a host not in the list."""
    members = Membership([Host("a.lab", 2), Host("b", 1), Host("c", 1)], 4, False, poll=5.0)
    changes = ChangeLog()
    lost = {"lost_workers": [
        {"rank": 3, "host": "c", "pid": 7, "reason": "its process died"},
        {"rank": 1, "host": "a", "pid": 5, "reason": "silent for 9 s"},  # a.lab: rank 0's
        {"rank": 2, "host": "elsewhere", "pid": 6, "reason": "?"}]}
    assert members.workers_lost(changes.workers_lost(lost, None, 4)) == [
        "host c left out (its worker, rank 3, was lost: its process died; lost 1 time(s)): "
        "probed again in 5 s, then every 5 s while the job runs"]
    assert list(members.left_out) == ["c"] and members.np_now() == 3
    members.take_back(["c"])
    assert changes.workers_lost(lost, None, 4) == []  # (later statuses repeat old losses)


def test_no_probe_while_the_job_has_all_the_ranks_it_asked_for():
    members = Membership(HOSTS + [Host("d", 1)], 4, False, poll=5.0)
    members.left_out["d"] = membership._LeftOut("new in the hostfile", 0.0, 0.0)
    assert members.np_now() == 4 and members.look(lambda names: {}) == []
    assert members._probing is None


#: a fake mpirun that acts as its plan says, attempt by attempt: "fail" checkpoints (at
#: step 100 times the attempt's number from 1), says running, notes 37 steps more and
#: fails; "run" checkpoints, says running and waits for the launcher's stop (then
#: checkpoints 50 steps later and stops as a run does: exit 143); "ok" ends well at once
PLANNED_MPIRUN = r"""
import json, os, signal, sys, time
from pathlib import Path
import numpy as np

results, np_, plan = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
token = os.environ["MPITRAIN_LAUNCH_ATTEMPT"]
attempts = results / "attempts"
attempts.mkdir(parents=True, exist_ok=True)
n = len(list(attempts.iterdir()))
(attempts / str(n)).write_text(str(np_))
run = results / "20260101-000000-fake"
run.mkdir(exist_ok=True)
step = 100 * (n + 1)

def checkpoint(step):
    header = {"step": step, "wall_time_s": step / 10}
    np.savez(run / "checkpoint.npz", meta=np.frombuffer(json.dumps(header).encode(), np.uint8))

checkpoint(step)

def status(value):
    with open("/proc/sys/kernel/random/boot_id") as f:
        writer = {"pid": os.getpid(), "boot_id": f.read().strip(),
                  "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    (run / "status.json").write_text(json.dumps(
        {"status": value, "reason": "", "launch_attempt": token, "writer": writer,
         "step": step}))

if plan[n] == "ok":
    status("ok")
    sys.exit(0)
if plan[n] == "brief":  # runs a while, then ends well by itself
    status("running")
    time.sleep(2)
    status("ok")
    sys.exit(0)
if plan[n] == "fail":
    status("running")
    step += 37
    status("running")
    sys.exit(1)
stopped = []
signal.signal(signal.SIGUSR1, lambda *_: stopped.append(1))
status("running")
deadline = time.monotonic() + 30
while not stopped and time.monotonic() < deadline:
    time.sleep(0.05)
step += 50
checkpoint(step)
status("interrupted")
sys.exit(143)
"""


def launch_losing_c(tmp_path, monkeypatch, then, plan="fail,run,ok", reset_limit=None):
    """-np 4 on a(2) b c from ``tmp_path/hostfile``: c is gone when the first attempt
    fails, so the job restarts on a and b at -np 3; ``then(gone)`` runs once the second
    attempt has begun (``gone``: the hosts the probes find gone). The launcher's exit
    code, the -np of each attempt, and its results directory."""
    gone = {"c"}

    def unreachable(hosts, mpirun_args, runner):
        return {h.name: "exit 255: ssh: connect to host c: No route to host"
                for h in hosts if h.name in gone}

    monkeypatch.setattr(membership, "unreachable", unreachable)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)
    results = tmp_path / "results"
    source = tmp_path / "hostfile"
    source.write_text("a slots=2\nb\nc\n")
    job = Job(4, list(HOSTS), str(source), False, [], async_mode=False,
              membership=Membership(list(HOSTS), 4, False, poll=0.2,
                                    source=HostfileSource(str(source))))
    job.command = lambda: [sys.executable, "-c", PLANNED_MPIRUN, str(results), str(job.np),
                           plan]
    launcher = Launcher(job, [], results, None, max_restarts=1)
    launcher.growth.reset_limit = reset_limit
    monkeypatch.setattr(launcher, "_on_signal", lambda *_: None)

    def once_running():
        while not (results / "attempts" / "1").exists():
            time.sleep(0.05)
        then(gone)

    threading.Thread(target=once_running, daemon=True).start()
    code = launcher.run()
    attempts = sorted((results / "attempts").iterdir(), key=lambda p: int(p.name))
    return code, [int(p.read_text()) for p in attempts], results, launcher


@pytest.mark.timeout(60)
def test_a_host_lost_then_back_is_taken_back_at_a_checkpoint(tmp_path, capsys, monkeypatch):
    """c answers again while the job runs on a and b: the launcher stops it (SIGUSR1)
    and restarts it from the checkpoint at -np 4 on all three."""
    code, nps, results, launcher = launch_losing_c(tmp_path, monkeypatch,
                                                   then=lambda gone: gone.clear())
    err = capsys.readouterr().err
    assert code == 0 and nps == [4, 3, 4], err
    assert "host c left out (mpirun cannot start a process there: exit 255" in err
    assert "-np 4 -> 3, the run resumes with fewer workers" in err
    assert "host(s) c answer: stopping the job at a checkpoint to take them in" in err
    assert "host(s) c answer: taken in" in err
    assert "-np 3 -> 4, the run resumes with more workers" in err
    assert "the run finished after 2 restart(s)" in err
    hosts = (results / "20260101-000000-fake" / "hostfile.launch").read_text().split()
    assert hosts == ["a", "slots=2", "b", "slots=1", "c", "slots=1"]
    # the stop to take c back is no failure: --max-restarts 1 had one failure to give
    assert launcher.failures == 1 and json.loads(
        (results / "20260101-000000-fake" / "status.json").read_text())["status"] == "ok"
    # each change a row of membership.csv: what it cost, from where the run went on
    failure, grow = read_csv(results / "20260101-000000-fake" / "membership.csv")
    assert {k: failure[k] for k in ("change", "hosts_out", "hosts_in", "np_before",
                                    "np_after", "step", "wall_time_s", "steps_lost",
                                    "why")} == {
        "change": "failure", "hosts_out": "c", "hosts_in": "", "np_before": "4",
        "np_after": "3", "step": "100", "wall_time_s": "10", "steps_lost": "37",
        "why": "mpirun exit 1"}
    assert {k: grow[k] for k in ("change", "hosts_out", "hosts_in", "np_before", "np_after",
                                 "step", "steps_lost", "why")} == {
        "change": "grow", "hosts_out": "", "hosts_in": "c", "np_before": "3",
        "np_after": "4", "step": "250", "steps_lost": "0", "why": "host(s) c answer"}
    assert all(0 < float(row["downtime_s"]) < 30 for row in (failure, grow))


@pytest.mark.timeout(60)
def test_past_the_reset_limit_the_job_keeps_its_size(tmp_path, capsys, monkeypatch):
    """--reset-limit 0: c answers again while the job runs on a and b, but the job is
    not stopped to take it back; it ends at -np 3 by itself."""
    code, nps, _, launcher = launch_losing_c(tmp_path, monkeypatch, lambda gone: gone.clear(),
                                             plan="fail,brief", reset_limit=0)
    err = capsys.readouterr().err
    assert code == 0 and nps == [4, 3], err
    assert "stopping the job at a checkpoint" not in err and launcher.growth.stops == 0


@pytest.mark.timeout(60)
def test_a_host_added_to_the_hostfile_replaces_a_lost_one(tmp_path, capsys, monkeypatch):
    """c stays gone; d replaces it in the hostfile while the job runs on a and b: d is
    probed, answers, and the job goes back to -np 4 on a, b and d."""
    def replace_c(gone):
        (tmp_path / "hostfile").write_text("a slots=2\nb\nd\n")

    code, nps, results, _ = launch_losing_c(tmp_path, monkeypatch, then=replace_c)
    err = capsys.readouterr().err
    assert code == 0 and nps == [4, 3, 4], err
    assert "host(s) d added: probed, and taken in if they answer" in err
    assert "host(s) d answer: stopping the job at a checkpoint" in err
    hosts = (results / "20260101-000000-fake" / "hostfile.launch").read_text().split()
    assert hosts == ["a", "slots=2", "b", "slots=1", "d", "slots=1"]


def elastic_launch(tmp_path, monkeypatch, gone, plan, comes_back=None, np_min=3):
    """-np NP_MIN:4 on a(2) b c, the probes finding ``gone`` gone: start as ``run`` does
    for -np MIN:MAX, then run the attempts of ``plan``; ``comes_back(gone)`` runs on a
    thread once the launch has begun. (exit code, -np of each attempt, stderr)."""
    def unreachable(hosts, mpirun_args, runner):
        return {h.name: "exit 255: no route to host" for h in hosts if h.name in gone}

    monkeypatch.setattr(membership, "unreachable", unreachable)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)
    results = tmp_path / "results"
    job = Job(4, list(HOSTS), "hostfile", False, [], async_mode=False,
              membership=Membership(list(HOSTS), 4, False, poll=0.2, np_min=np_min))
    job.command = lambda: [sys.executable, "-c", PLANNED_MPIRUN, str(results), str(job.np),
                           ",".join(plan)]
    launcher = Launcher(job, [], results, None, max_restarts=0)
    monkeypatch.setattr(launcher, "_on_signal", lambda *_: None)
    if comes_back:
        threading.Thread(target=comes_back, args=(gone,), daemon=True).start()
    for line in job.rehost(launcher.hostfile_path(), announce=launch.say, starting=True):
        launch.say(line)
    code = launcher.run()
    attempts = sorted((results / "attempts").iterdir(), key=lambda p: int(p.name))
    return code, [int(p.read_text()) for p in attempts]


@pytest.mark.timeout(60)
def test_np_min_max_starts_on_the_hosts_that_answer_and_grows(tmp_path, capsys, monkeypatch):
    """-np 3:4 with c not answering at the launch: the job starts on a and b at -np 3,
    and goes to -np 4 once c answers."""
    def later(gone):
        time.sleep(1.0)
        gone.clear()

    code, nps = elastic_launch(tmp_path, monkeypatch, {"c"}, ["run", "ok"], later)
    err = capsys.readouterr().err
    assert code == 0 and nps == [3, 4], err
    assert "host c left out (mpirun cannot start a process there: exit 255" in err
    assert "-np 4 -> 3, the run starts on the 3 rank(s) their slots hold" in err
    assert "-np 3 -> 4, the run resumes with more workers" in err


@pytest.mark.timeout(60)
def test_np_min_max_waits_for_hosts_below_its_minimum(tmp_path, capsys, monkeypatch):
    """b and c not answering leave a's 2 slots, under -np 3:4's minimum: the launcher
    says it waits, and starts at -np 3 once c answers; with neither back within
    HOSTS_WAIT it gives up in one line."""
    monkeypatch.setattr(membership, "HOSTS_WAIT", 20.0)

    def c_later(gone):
        time.sleep(0.5)
        gone.discard("c")

    code, nps = elastic_launch(tmp_path, monkeypatch, {"b", "c"}, ["ok"], c_later)
    err = capsys.readouterr().err
    assert code == 0 and nps == [3], err
    assert "the hosts that answer hold 2 rank(s), fewer than -np 3:4's minimum: waiting " \
           "up to 20 s for hosts to answer (left out: b: mpirun cannot start a process " \
           "there: exit 255: no route to host; c: " in err

    monkeypatch.setattr(membership, "HOSTS_WAIT", 0.5)
    with pytest.raises(MpitrainError, match=r"^-np 3:4: the hosts that answer hold 2 "
                       r"rank\(s\) after 0.5 s of waiting \(left out: b: .*; c: .*\); "
                       r"bring hosts back, then launch again"):
        elastic_launch(tmp_path / "2", monkeypatch, {"b", "c"}, ["ok"])


def test_np_takes_n_or_min_max():
    assert command.np_range("4") == (4, 4) and command.np_range("2:4") == (2, 4)
    for bad in ("0", "4:2", "x", "2:", ":4", "1:2:3"):
        with pytest.raises(Exception, match="must be N or MIN:MAX with 1 <= MIN <= MAX"):
            command.np_range(bad)


def test_min_np_and_max_np_are_horovodruns_spelling_of_min_max():
    """--min-np/--max-np give -np MIN:MAX's bounds (MIN 1 by default); with -np too, or
    without --max-np, or out of order, one usage line says what to give."""
    import argparse

    def given(np_range=None, min_np=None, max_np=None):
        return command.bounds_given(argparse.Namespace(np_range=np_range, min_np=min_np,
                                                       max_np=max_np))

    assert given((2, 4)) == (2, 4) and given() is None
    assert given(min_np=2, max_np=8) == (2, 8) and given(max_np=8) == (1, 8)
    assert command.world_size(argparse.Namespace(np_range=None, min_np=2, max_np=8)) == 8
    for bad in ({"np_range": (4, 4), "max_np": 8}, {"min_np": 2}):
        with pytest.raises(UsageError, match=r"^give -np MIN:MAX, or --max-np MAX with "
                           r"--min-np MIN \(default 1\) and no -np"):
            given(**bad)
    with pytest.raises(UsageError, match=r"^--min-np/--max-np must be N or MIN:MAX with "
                       r"1 <= MIN <= MAX \(got '8:2'\)$"):
        given(min_np=8, max_np=2)
