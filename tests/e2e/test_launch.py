"""``mpitrain launch``: real mpirun jobs, real SIGKILLs and signals, real restarts."""

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

from conftest import (LOCAL_HOSTFILE, finish_bounded, mpi_env, mpirun, read_rows, rows_so_far,
                      run_bounded, start_bounded, wait_for)
from mpitrain.launch.dialect import RUN_AS_ROOT_CONSENT
from mpitrain.userfiles import read_json_object

# LR with small batches: ~1,300 steps per epoch per worker at -np 4, a few seconds
# an epoch, so a kill lands mid-run, after the first checkpoint
TRAINING = ["lr", "--batch-size", "5", "--lr", "0.05", "--epochs", "4", "--quiet"]


def launch_cmd(*args):
    return [sys.executable, "-m", "mpitrain", "launch", *map(str, args)]


def start_launch(*args, env=None) -> subprocess.Popen:
    return start_bounded(launch_cmd(*args), env)


def finish(proc: subprocess.Popen, timeout: float):
    done = finish_bounded(proc, timeout)
    return done.returncode, done.stdout, done.stderr


def the_run_dir(results: Path) -> Path:
    return wait_for(lambda: next((p for p in results.glob("*-lr-*") if p.is_dir()), None),
                    120, "the run directory")


def checkpoint_step(run_dir: Path) -> int:
    from mpitrain.run.checkpoint import Checkpoint

    try:
        return Checkpoint.load(run_dir).step
    except Exception:  # not written yet (or being replaced)
        return 0


def rank_pids(run_dir: Path, after: float) -> list:
    """The pids of the attempt whose metadata was written after ``after`` (config.json
    for the first, resumed-*.json for the restarts)."""
    def newest():
        files = [p for p in [run_dir / "config.json", *run_dir.glob("resumed-*.json")]
                 if p.is_file() and p.stat().st_mtime > after]
        return max(files, key=lambda p: p.stat().st_mtime) if files else None
    meta = wait_for(newest, 120, "the attempt's metadata")
    return [rank["pid"] for rank in json.loads(meta.read_text())["ranks"]]


def leftovers(marker: str) -> list:
    """Processes still running whose command line mentions ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def final_weights(results: Path) -> np.ndarray:
    row = read_rows(results / "runs.csv")[-1]
    with np.load(results / row["run"] / "checkpoint.npz") as ckpt:
        return ckpt["weights"].copy()


@pytest.mark.slow
def test_sync_run_survives_a_killed_worker_then_a_killed_server(mnist, tmp_path):
    """kill -9 worker 2 after the first checkpoint (--checkpoint-steps), then rank 0 (the
    parameter server) after the restart's next checkpoint: the run completes after two restarts, in one
    results directory with one curve, and (sync resume is bit-exact) ends with the
    very weights of a run that was never interrupted."""
    # -np 3: 2 workers, 2 epochs of 2,000 steps each (batches of 5)
    training = [*TRAINING[:-3], "--epochs", "2", "--quiet"]
    reference = tmp_path / "reference"
    clean = mpirun(3, *training, "--data-dir", mnist, "--results-dir", reference, timeout=600)
    assert clean.returncode == 0, clean.stderr[-3000:]

    results = tmp_path / "launched"
    t0 = time.time()
    # checkpoints every 200 steps too (mid-epoch), which must not change a single weight,
    # and a restart resumes mid-epoch; the second kill comes at step 400 or soon after
    proc = start_launch("-np", 3, "-hostfile", LOCAL_HOSTFILE, *training, "--data-dir", mnist,
                        "--results-dir", results, "--checkpoint-steps", 200)
    run_dir = the_run_dir(results)
    first = wait_for(lambda: checkpoint_step(run_dir), 300, "the first checkpoint")
    assert first % 200 == 0, first
    os.kill(rank_pids(run_dir, t0)[2], signal.SIGKILL)
    t1 = time.time()
    wait_for(lambda: checkpoint_step(run_dir) > first, 300, "a checkpoint after the restart")
    os.kill(rank_pids(run_dir, t1)[0], signal.SIGKILL)
    code, _, err = finish(proc, 600)

    assert code == 0, err[-3000:]
    assert err.count("the job failed") == 2 and "finished after 2 restart(s)" in err, err
    assert [p.name for p in results.iterdir() if p.is_dir()] == [run_dir.name]
    rows = read_rows(results / "runs.csv")
    assert rows[-1]["status"] == "ok" and float(rows[-1]["epochs"]) == 2
    # every attempt keeps its row, also one whose rank 0 was killed before writing it
    assert [(r["status"], r["run"], bool(r["reason"])) for r in rows[:-1]] == [
        ("failed", run_dir.name, True)] * 2, (rows, (run_dir / "status.json").read_text(), err)
    curve = read_rows(run_dir / "curve.csv")
    steps = [int(r["step"]) for r in curve]
    assert steps == sorted(set(steps)) and steps[-1] == int(rows[-1]["steps"])
    np.testing.assert_array_equal(final_weights(results), final_weights(reference))
    assert leftovers(str(results)) == []


@pytest.mark.slow
def test_async_run_survives_a_killed_server_under_recovery(mnist, tmp_path):
    """An async job runs under --enable-recovery, where a dead rank does not end the job:
    kill -9 the server after the first checkpoint, and its workers (on its host) stop
    within seconds, so the launcher restarts at once (they used to wait out their reply
    bound, twice --timeout: ten minutes) and the run finishes."""
    results = tmp_path / "launched"
    proc = start_launch("-np", 3, "-hostfile", LOCAL_HOSTFILE, *TRAINING[:-3], "--epochs", "2",
                        "--quiet", "--async", "--data-dir", mnist, "--results-dir", results,
                        "--checkpoint-steps", 500)
    run_dir = the_run_dir(results)
    wait_for(lambda: checkpoint_step(run_dir), 300, "the first checkpoint")
    os.kill(rank_pids(run_dir, 0)[0], signal.SIGKILL)
    code, _, err = finish(proc, 180)  # within the workers' default reply bound (600 s)
    assert code == 0, err[-3000:]
    assert "the parameter server, rank 0 on" in err and "has died" in err, err[-3000:]
    assert err.count("has died") == 1, err  # said once, though both workers saw it
    assert err.count("mpitrain: error") == 1, err  # one error line for the one failure
    assert err.count("the job failed") == 1 and "finished after 1 restart(s)" in err, err
    rows = read_rows(results / "runs.csv")
    assert rows[-1]["status"] == "ok" and float(rows[-1]["epochs"]) == pytest.approx(2, abs=0.05)
    assert leftovers(str(results)) == []


@pytest.mark.slow
def test_two_servers_lose_a_worker_then_a_share_server(mnist, tmp_path):
    """Async with --servers 2 at -np 4 (2 workers) under the launcher (recovery on):
    stop worker 3 after the first evaluation, and both servers drop it while the other
    worker trains on; then kill -9 rank 1, the server of the second share: one line
    names it, the launcher restarts from the one canonical checkpoint, and the run
    finishes with every share applied as often as the other.

    The stalled worker is dropped after its 4 s liveness floor, ten times the time
    the other takes to reach the next checkpoint: so the drop always finds a cut
    waiting for the stalled worker's push alone (once a crash: no lease left to wait
    for, the cut was never made)."""
    results = tmp_path / "launched"
    t0 = time.time()
    proc = start_launch("-np", 4, "-hostfile", LOCAL_HOSTFILE, *TRAINING[:-3], "--epochs", "3",
                        "--quiet", "--async", "--servers", 2, "--liveness-floor", 4,
                        "--data-dir", mnist, "--results-dir", results,
                        "--checkpoint-steps", 100)
    run_dir = the_run_dir(results)
    pids = rank_pids(run_dir, t0)
    wait_for(lambda: len(rows_so_far(run_dir / "curve.csv")) >= 2, 300, "the first evaluation")
    os.kill(pids[3], signal.SIGSTOP)
    lost = wait_for(lambda: checkpoint_step(run_dir) and
                    (read_json_object(run_dir / "status.json") or {}).get("lost_workers"),
                    300, "worker 3 to be dropped")
    assert [w["rank"] for w in lost] == [3], lost
    # at once: the run can end within a checkpoint interval of the loss on a loaded host
    t1 = time.time()
    os.kill(pids[1], signal.SIGKILL)
    code, out, err = finish(proc, 600)

    assert code == 0, err[-3000:]
    assert "lost rank 3" in out and "training continues with 1 worker(s)" in out, out[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("mpitrain: error")]
    assert len(errors) == 1 and "rank 1" in errors[0], err[-3000:]
    assert err.count("the job failed") == 1 and "finished after 1 restart(s)" in err, err
    assert rank_pids(run_dir, t1) != pids  # a new attempt, with its own ranks
    rows = read_rows(results / "runs.csv")
    assert [r["status"] for r in rows] == ["failed", "ok"], rows
    last = rows[-1]
    assert (last["servers"], float(last["epochs"])) == ("2", pytest.approx(3, abs=0.05)), last
    applied = dict(pair.split(":") for pair in last["applied_by_server"].split())
    assert set(applied) == {"0", "1"} and applied["0"] == applied["1"], last
    assert leftovers(str(results)) == []


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to an async run"])
def test_stop_signal_checkpoints_and_is_not_restarted(mnist, tmp_path, how):
    """SIGTERM to the launcher (what SLURM sends), or SIGINT to its process group (Ctrl-C
    in a terminal; Open MPI's mpirun itself exits 1 on it: issue 53 item 5), becomes a
    graceful stop of every rank: exit 143 and its line, a checkpoint, no restart, no
    process left behind. The async run is under --enable-recovery, where Open MPI 4's
    mpirun exits 0 whatever its ranks return (the launcher took the stop for a finished
    run): the run's recorded end decides. Started without Open
    MPI's two run-as-root variables: as root (containers, this CI) the launcher gives
    them to the mpirun it starts, as Horovod's does (before, Open MPI's page of refusal,
    one retry, and a failed launch)."""
    results = tmp_path / "results"
    env = mpi_env()
    for name in RUN_AS_ROOT_CONSENT:
        env.pop(name)
    mode = ["--async"] if "async" in how else []
    proc = start_launch("-np", 3, "-hostfile", LOCAL_HOSTFILE, *TRAINING, *mode, "--data-dir",
                        mnist, "--results-dir", results, env=env)
    run_dir = the_run_dir(results)
    wait_for(lambda: len(rows_so_far(run_dir / "curve.csv")) >= 1, 120, "training to start")
    if how.startswith("Ctrl-C"):
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, 300)
    assert code == 143, err[-3000:]
    assert "the job failed" not in err and "stopped (exit 143)" in err
    assert "mpitrain: interrupted: stopped by SIG" in out + err
    assert read_rows(results / "runs.csv")[-1]["status"] == "interrupted"
    assert (run_dir / "checkpoint.npz").is_file()
    assert leftovers(str(results)) == []
    # rank 0 got the attempt's token through mpirun and kept it, and itself as the
    # writer, from running to its end
    status = json.loads((run_dir / "status.json").read_text())
    rank_0 = json.loads((run_dir / "config.json").read_text())["ranks"][0]["pid"]
    assert len(status["launch_attempt"]) == 32 and status["writer"]["pid"] == rank_0


def test_a_job_failing_before_any_checkpoint_is_not_retried_forever(tmp_path):
    bad = tmp_path / "no-mnist-here"
    bad.mkdir()
    result = run_bounded(launch_cmd("-np", 2, "--max-restarts", 5, "lr", "--dataset", "mnist",
                                    "--data-dir", bad, "--results-dir", tmp_path / "r"),
                         timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("mpitrain: error:") == 2  # the first attempt and one retry
    assert "failed (exit 1) twice before its first checkpoint; giving up" in result.stderr


@pytest.mark.parametrize("args,message", [
    (["-np", "5", "-hostfile", "hostfiles/cluster2", "lr"], "needs 5 slots"),
    (["-np", "1", "lr", "--async"], "--async needs a parameter server"),
    (["--max-restarts", "-1", "lr"], "--max-restarts must be 0 or more"),
    (["--reset-limit", "-1", "lr"], "--reset-limit must be 0 or more"),
    (["-np", "2", "lr", "--epochs", "0"], "--epochs must be a positive integer"),
    (["-np", "4:2", "lr"], "-np/--np: must be N or MIN:MAX with 1 <= MIN <= MAX"),
    (["-np", "2:4", "lr"], "-np 2:4 takes the hosts that answer from a hostfile"),
    (["-hostfile", "hostfiles/local", "--host-discovery-script", "/bin/true", "lr"],
     "give -hostfile FILE or --host-discovery-script SCRIPT, not both"),
    (["-np", "2", "--host-discovery-script", "/no/such/script", "lr"],
     "discovery script /no/such/script cannot be run (No such file or directory): give the "
     "path of an executable"),
    (["--host-poll", "-1", "lr"], "--host-poll and --hosts-wait must be 0 (off) or a number"),
])
def test_usage_errors_are_one_line_before_any_launch(args, message):
    result = run_bounded(launch_cmd(*args), timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("mpitrain: error:") == 1 and message in result.stderr
    assert "$ mpirun" not in result.stderr


def test_a_host_unreachable_at_the_start_is_an_error_not_a_smaller_run(tmp_path):
    """A typo in a host name: before, the first attempt failed, the host was dropped and
    the run restarted from scratch on half the workers (a smaller global batch, nothing
    recorded). A run that has not begun is never rescaled: one line, exit 1, no job."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\nlocalhsot slots=2\n")
    result = run_bounded(launch_cmd("-np", 4, "-hostfile", hosts, "lr", "--results-dir",
                                    tmp_path / "r"), timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("mpitrain: error:") == 1
    assert "host(s) localhsot cannot be reached: mpirun cannot start a process there " \
        "(localhsot: exit" in result.stderr
    assert "$ " not in result.stderr and not (tmp_path / "r").exists()


def test_hosts_mpirun_cannot_reach_are_left_out(tmp_path):
    """The probe before a restart is a real mpirun per host: an unresolvable host is
    left out of the next attempt's hostfile and -np drops to the slots left; without
    enough left for the mode, the launcher gives up with one line. The probes get Open
    MPI's run-as-root consent from the launcher (this process need not have it)."""
    from mpi4py import MPI  # noqa: F401  # the probes must work from a process that has
    # initialised MPI itself (as this test runner has after the in-process MPI tests)
    from mpitrain.errors import UsageError
    from mpitrain.launch.job import Job
    from mpitrain.launch import hostfile

    from mpitrain.launch.membership import Membership

    def job_on(text, oversubscribe=False, async_mode=True):
        hosts = hostfile.parse(text)
        return Job(4, hosts, "cluster", oversubscribe, [], async_mode=async_mode,
                   membership=Membership(hosts, 4, oversubscribe))

    job = job_on("localhost slots=2\nno-such-host.invalid slots=2\n")
    changed = "\n".join(job.rehost(tmp_path / "hostfile.launch"))
    assert "host no-such-host.invalid left out (mpirun cannot start a process there: " \
        "exit " in changed
    assert "-np 4 -> 2, the run resumes with fewer workers" in changed
    assert (job.np, job.hostfile) == (2, str(tmp_path / "hostfile.launch"))
    assert (tmp_path / "hostfile.launch").read_text() == "localhost slots=2\n"
    assert "-np 2 -hostfile " + str(tmp_path / "hostfile.launch") in " ".join(job.command())
    assert job.rehost(tmp_path / "again") == []  # nothing else is gone, none cooled yet

    alone = job_on("localhost slots=1\nno-such-host.invalid slots=3\n")
    with pytest.raises(UsageError, match="too few to continue the run"):
        alone.rehost(tmp_path / "h")
    crowded = job_on("localhost slots=2\nno-such-host.invalid slots=2\n", True, False)
    assert "-np" not in "".join(crowded.rehost(tmp_path / "o")) and crowded.np == 4


# ---- a script that cannot succeed (issue 53, item 6) ------------------------------------
#: fails as its state file says: the attempts' errors in turn ('ok': exits 0)
FAILING_SCRIPT = """
import os
import sys
from pathlib import Path
state = Path(sys.argv[1])
outcomes = state.read_text().split(",")
attempt = len(list(state.parent.glob("attempt-*")))
Path(state.parent, f"attempt-{attempt}-{os.getpid()}").touch()
outcome = outcomes[min(attempt, len(outcomes) - 1)]
if outcome != "ok":
    raise RuntimeError(outcome)
"""


@pytest.mark.parametrize("outcomes,code,attempts", [
    # the same error twice: given up after the second attempt, not after --max-restarts
    ("cannot open data.npz", 1, 2),
    # another error each time: restarted, and the third attempt succeeds
    ("disk hiccup at step 7,node lost at step 12,ok", 0, 3)])
def test_a_script_that_fails_the_same_way_twice_is_not_restarted_again(
        tmp_path, outcomes, code, attempts):
    script, state = tmp_path / "crash.py", tmp_path / "state" / "outcomes"
    script.write_text(FAILING_SCRIPT)
    state.parent.mkdir()
    state.write_text(outcomes)
    result = run_bounded(launch_cmd("-np", 1, "--max-restarts", 5, script, state), 300,
                         env=mpi_env())
    assert result.returncode == code, result.stderr[-2000:]
    assert len(list(state.parent.glob("attempt-*"))) == attempts
    if code:
        assert "the script failed the same way twice (exit 1: RuntimeError: cannot open " \
            "data.npz); a restart cannot help: giving up" in result.stderr
        assert result.stderr.count("RuntimeError: cannot open data.npz") == 3  # passed on
