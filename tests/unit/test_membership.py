"""Hosts that are lost and come back (mpitrain.launch.membership): the bookkeeping on a
fake clock, then the launcher taking a host back with a real (fake) mpirun process:
left out after a failure, found answering while the job runs, the job stopped at a
checkpoint and restarted on it. The same on a real emulated cluster:
tests/e2e/test_netns.py."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from mpitrain.launch import job as launch
from mpitrain.launch import membership
from mpitrain.launch.hostfile import Host
from mpitrain.launch.job import Job, Launcher
from mpitrain.launch.membership import MAX_COOLDOWN, Membership

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
    members = Membership(HOSTS, 4, False, poll=5.0, clock=clock, source=str(path))
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


def test_no_probe_while_the_job_has_all_the_ranks_it_asked_for():
    members = Membership(HOSTS + [Host("d", 1)], 4, False, poll=5.0)
    members.left_out["d"] = membership._LeftOut("new in the hostfile", 0.0, 0.0)
    assert members.np_now() == 4 and members.look(lambda names: {}) == []
    assert members._probing is None


#: a fake mpirun: the first attempt checkpoints and fails; a resumed one says running
#: and waits for SIGUSR1 (the launcher's stop), then stops as a run does (status
#: interrupted, exit 143) unless it is the last (it then ends ok at once)
FAKE_MPIRUN = r"""
import json, os, signal, sys, time
from pathlib import Path

results, np_ = Path(sys.argv[1]), int(sys.argv[2])
token = os.environ["MPITRAIN_LAUNCH_ATTEMPT"]
attempts = results / "attempts"
attempts.mkdir(parents=True, exist_ok=True)
n = len(list(attempts.iterdir()))
(attempts / str(n)).write_text(str(np_))
run = results / "20260101-000000-fake"

def status(value):
    with open("/proc/sys/kernel/random/boot_id") as f:
        writer = {"pid": os.getpid(), "boot_id": f.read().strip(),
                  "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    (run / "status.json").write_text(json.dumps(
        {"status": value, "reason": "", "launch_attempt": token, "writer": writer}))

if n == 0:
    run.mkdir()
    (run / "checkpoint.npz").touch()
    status("running")
    sys.exit(1)
if n == 2:
    status("ok")
    sys.exit(0)
stopped = []
signal.signal(signal.SIGUSR1, lambda *_: stopped.append(1))
status("running")
deadline = time.monotonic() + 30
while not stopped and time.monotonic() < deadline:
    time.sleep(0.05)
status("interrupted")
sys.exit(143)
"""


def launch_losing_c(tmp_path, monkeypatch, then):
    """-np 4 on a(2) b c from ``tmp_path/hostfile``: c is gone when the first attempt
    fails, so the job restarts on a and b at -np 3; ``then(gone)`` runs once the second
    attempt has begun (``gone``: the hosts the probes find gone). The launcher's exit
    code, the -np of each attempt, and its results directory."""
    gone = {"c"}

    def unreachable(hosts, mpirun_args, runner):
        return {h.name: "exit 255: ssh: connect to host c: No route to host"
                for h in hosts if h.name in gone}

    monkeypatch.setattr(launch, "unreachable", unreachable)
    monkeypatch.setattr(membership, "unreachable", unreachable)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)
    results = tmp_path / "results"
    source = tmp_path / "hostfile"
    source.write_text("a slots=2\nb\nc\n")
    job = Job(4, list(HOSTS), str(source), False, [], async_mode=False,
              membership=Membership(list(HOSTS), 4, False, poll=0.2, source=str(source)))
    job.command = lambda: [sys.executable, "-c", FAKE_MPIRUN, str(results), str(job.np)]
    launcher = Launcher(job, [], results, None, max_restarts=1)
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
