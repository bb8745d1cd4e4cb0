"""Where a launch's hosts come from (mpitrain.launch.discovery): real discovery scripts
(answering, failing, hanging, printing what cannot be read), SLURM's per-node counts,
and the launcher starting from a script's hosts and growing when the script lists one
more (a fake mpirun, as in test_membership.py; on the emulated cluster:
tests/e2e/test_netns.py)."""

import stat
import sys
import threading
import time

import pytest

from mpitrain.errors import UsageError
from mpitrain.launch import job as launch
from mpitrain.launch import membership
from mpitrain.launch.discovery import DiscoveryScript, SlurmAllocation, tasks_per_node
from mpitrain.launch.hostfile import Host
from mpitrain.launch.job import Job, Launcher
from mpitrain.launch.membership import Membership

from test_membership import PLANNED_MPIRUN


def script(tmp_path, body: str, name: str = "discover"):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def settle(source: DiscoveryScript):
    """Poll until a run of the script has finished and been taken in; what it found."""
    source.poll()  # starts a run
    deadline = time.monotonic() + 20
    while source._running is not None and source._running.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    source.every = 3600.0  # (this poll only harvests)
    found = source.poll()
    source.every = 0.0
    return found


def test_a_script_lists_hosts_with_their_slots(tmp_path):
    path = script(tmp_path, "echo 'a:2'; echo b; echo '# a comment'; echo 'c slots=3'")
    assert DiscoveryScript(path).read() == [Host("a", 2), Host("b", 1), Host("c", 3)]
    assert DiscoveryScript(script(tmp_path, "true", "none")).read() == []  # no host now


def test_polls_report_a_changed_list_once(tmp_path):
    listing = tmp_path / "hosts"
    listing.write_text("a:2\n")
    source = DiscoveryScript(script(tmp_path, f"cat {listing}"), every=0.0)
    assert source.poll() == (None, [])  # (its first run has only begun)
    assert settle(source) == ([Host("a", 2)], [])
    assert settle(source) == (None, [])  # the same hosts: nothing to say
    listing.write_text("a:2\nb:1\n")
    assert settle(source) == ([Host("a", 2), Host("b", 1)], [])


def test_a_script_that_fails_keeps_the_hosts_and_says_so_once(tmp_path):
    flag = tmp_path / "fail"
    path = script(tmp_path, f"if [ -e {flag} ]; then echo 'cloud API: 503' >&2; exit 3; fi; "
                  "echo a:2")
    source = DiscoveryScript(path, every=0.0)
    assert source.read() == [Host("a", 2)]
    flag.touch()
    assert settle(source) == (None, [f"discovery script {path} exited 3 (cloud API: 503): "
                                     "the hosts stay as they were"])
    assert settle(source) == (None, [])  # said once
    assert source.last == [Host("a", 2)]
    with pytest.raises(UsageError, match=r"exited 3 \(cloud API: 503\)$"):
        source.read()  # (at the launch: the launch fails with that line)


def test_a_script_that_hangs_is_killed_with_what_it_started(tmp_path):
    path = script(tmp_path, "echo a:2; sleep 60 & sleep 60")  # a child holds its output
    began = time.monotonic()
    with pytest.raises(UsageError, match=r"^discovery script .* did not finish within "
                       r"0.5 s \(killed\)$"):
        DiscoveryScript(path, timeout=0.5).read()
    assert time.monotonic() - began < 10


def test_a_script_that_lies_or_cannot_run_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"discovery script .*:1: cannot read 'a:x'"):
        DiscoveryScript(script(tmp_path, "echo a:x")).read()
    plain = tmp_path / "not-executable"
    plain.write_text("echo a\n")
    with pytest.raises(UsageError, match=r"cannot be run \(Permission denied\): give the "
                       r"path of an executable \(chmod \+x\)"):
        DiscoveryScript(str(plain)).read()


def test_slurm_counts_per_node():
    assert tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    assert tasks_per_node("4", 1) == [4]
    assert tasks_per_node("", 2) == [1, 1] and tasks_per_node("2(x3)", 2) == [1, 1]
    with pytest.raises(UsageError, match=r"\$SLURM_JOB_NODELIST is not set"):
        SlurmAllocation({"SLURM_JOB_ID": "7"}).read()


def test_membership_takes_a_scripts_new_hosts_as_hosts_to_probe(tmp_path):
    listing = tmp_path / "hosts"
    listing.write_text("a:2\nb\n")
    source = DiscoveryScript(script(tmp_path, f"cat {listing}"))
    members = Membership(source.read(), 4, False, poll=5.0, source=source)
    listing.write_text("a:2\nc\n")
    where = f"discovery script {source.path}"
    assert members.reread(now=True) == [
        f"{where}: host(s) c added: probed, and taken in if they answer and the job is "
        "short of slots", f"{where}: host(s) b removed: the job leaves them at its next "
        "restart"]
    assert members.cooled() == ["c"] and members.left_out["c"].why == f"new in {where}"


@pytest.mark.timeout(60)
def test_the_launcher_starts_on_a_scripts_hosts_and_grows_when_it_lists_more(
        tmp_path, capsys, monkeypatch):
    """-np 2:4 from a script that lists a(2) and a host that does not answer (z): the
    job starts on a at -np 2; the script then lists b too, which answers: the job is
    stopped at a checkpoint and goes on at -np 3 on a and b; z stays left out."""
    def unreachable(hosts, mpirun_args, runner):
        return {h.name: "exit 255: no such host" for h in hosts if h.name == "z"}

    monkeypatch.setattr(membership, "unreachable", unreachable)
    monkeypatch.setattr(launch, "POLL_INTERVAL", 0.1)
    listing = tmp_path / "hosts"
    listing.write_text("a:2\nz\n")
    source = DiscoveryScript(script(tmp_path, f"cat {listing}"), every=0.1)
    results = tmp_path / "results"
    job = Job(4, None, None, False, [], async_mode=False,
              membership=Membership(source.read(), 4, False, poll=0.2, np_min=2,
                                    source=source))
    job.command = lambda: [sys.executable, "-c", PLANNED_MPIRUN, str(results), str(job.np),
                           "run,ok"]
    launcher = Launcher(job, [], results, None, max_restarts=0)
    monkeypatch.setattr(launcher, "_on_signal", lambda *_: None)

    def b_appears():
        while not (results / "attempts" / "0").exists():
            time.sleep(0.05)
        listing.write_text("a:2\nz\nb\n")

    threading.Thread(target=b_appears, daemon=True).start()
    for line in job.rehost(launcher.hostfile_path(), announce=launch.say, starting=True):
        launch.say(line)
    code = launcher.run()
    err = capsys.readouterr().err
    attempts = sorted((results / "attempts").iterdir(), key=lambda p: int(p.name))
    assert code == 0 and [int(p.read_text()) for p in attempts] == [2, 3], err
    assert "host z left out (mpirun cannot start a process there: exit 255: no such host" \
        in err
    assert f"discovery script {source.path}: host(s) b added" in err
    assert "host(s) b answer: stopping the job at a checkpoint to take them in" in err
    assert "-np 4 -> 2, the run starts on the 2 rank(s) their slots hold" in err
    assert "-np 2 -> 3, the run resumes with more workers" in err
    hosts = (results / "20260101-000000-fake" / "hostfile.launch").read_text().split()
    assert hosts == ["a", "slots=2", "b", "slots=1"]
