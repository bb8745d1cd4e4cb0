"""Hosts that are lost and come back (mpitrain.launch.membership): the bookkeeping on a
fake clock, then the launcher taking a host back with a real (fake) mpirun process:
left out after a failure, found answering while the job runs, the job stopped at a
checkpoint and restarted on it. The same on a real emulated cluster:
tests/e2e/test_netns.py."""

import json
import sys
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


@pytest.mark.timeout(60)
def test_a_host_lost_then_back_is_taken_back_at_a_checkpoint(tmp_path, capsys, monkeypatch):
    """-np 4 on a(2) b c: c is gone when the first attempt fails, so the job restarts
    on a and b at -np 3; c answers again while it runs: the launcher stops it (SIGUSR1),
    and restarts it from the checkpoint at -np 4 on all three."""
    gone = {"c"}

    def unreachable(hosts, mpirun_args, runner):
        return {h.name: "exit 255: ssh: connect to host c: No route to host"
                for h in hosts if h.name in gone}

    monkeypatch.setattr(launch, "unreachable", unreachable)
    monkeypatch.setattr(membership, "unreachable", unreachable)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)
    results = tmp_path / "results"
    job = Job(4, list(HOSTS), "hostfile", False, [], async_mode=False,
              membership=Membership(list(HOSTS), 4, False, poll=0.2))
    job.command = lambda: [sys.executable, "-c", FAKE_MPIRUN, str(results), str(job.np)]
    launcher = Launcher(job, [], results, None, max_restarts=1)
    monkeypatch.setattr(launcher, "_on_signal", lambda *_: None)

    def back_once_running():  # c comes back while the second attempt runs
        while not (results / "attempts" / "1").exists():
            time.sleep(0.05)
        gone.clear()

    import threading
    threading.Thread(target=back_once_running, daemon=True).start()
    assert launcher.run() == 0
    err = capsys.readouterr().err
    nps = [int((results / "attempts" / str(n)).read_text()) for n in range(3)]
    assert nps == [4, 3, 4], err
    assert "host c left out (mpirun cannot start a process there: exit 255" in err
    assert "-np 4 -> 3, the run resumes with fewer workers" in err
    assert "host(s) c answer again: stopping the job at a checkpoint to take them back" in err
    assert "host(s) c answer again: taken back" in err
    assert "-np 3 -> 4, the run resumes with more workers" in err
    assert "the run finished after 2 restart(s)" in err
    hosts = (results / "20260101-000000-fake" / "hostfile.launch").read_text().split()
    assert hosts == ["a", "slots=2", "b", "slots=1", "c", "slots=1"]
    # the stop to take c back is no failure: --max-restarts 1 had one failure to give
    assert launcher.failures == 1 and json.loads(
        (results / "20260101-000000-fake" / "status.json").read_text())["status"] == "ok"
