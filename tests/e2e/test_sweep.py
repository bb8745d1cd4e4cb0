"""Sweeps: a tiny 2x2 grid completes, and resumes after a kill without redoing runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, mpi_env, read_rows, run_bounded
from mpitrain.launch import sweep
from mpitrain.errors import UsageError


def test_grid_expansion_drops_and_merges():
    runs = sweep.expand({"model": ["lr"], "mode": ["single", "sync", "async"], "np": [1, 4]})
    assert [r.key for r in runs] == ["lr-single-np1-bsdefault-edefault",
                                     "lr-sync-np4-bsdefault-edefault",
                                     "lr-async-np4-bsdefault-edefault"]
    with pytest.raises(UsageError, match="no runnable combination"):
        sweep.expand({"model": ["lr"], "mode": ["async"], "np": [1]})
    with pytest.raises(UsageError, match="unknown sweep keys"):
        sweep.expand({"model": ["lr"], "gpus": [2]})
    run = sweep.SweepPoint("lenet", "async", 3, 2, batch_size=64)
    assert run.args({"steps": 5, "quiet": True}) == [
        "lenet", "--async", "--epochs", "2", "--batch-size", "64", "--steps", "5", "--quiet"]


def test_a_second_sweep_into_one_results_directory_is_refused(tmp_path):
    """Issue 53 item 3: the same sweep started twice at once ran every point twice. The
    first holds the directory's lock; the second is refused before it runs anything, and
    once the first has ended (killed, here) the lock is free again."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path / "sweep.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = sweep.Sweep(sweep.expand({"model": ["lr"], "np": [1]}), tmp_path, {})
        with pytest.raises(UsageError, match=rf"another mpitrain sweep \(pid {holder.pid}\) "
                                             "is running into this results directory"):
            second.run()
        assert not (tmp_path / "manifest.json").exists()
    finally:
        holder.kill()
        holder.wait()
    fd = second._lock()  # the kernel let the lock go with its process
    os.close(fd)


def test_experiment_specs_expand():
    for spec in sorted((REPO / "experiments").glob("*.toml")):
        runs = sweep.expand(sweep.load_spec(spec)["grid"])
        assert runs, spec


def manifest(results: Path) -> dict:
    try:
        return json.loads((results / "manifest.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return {}


def sweep_cmd(results: Path, mnist: Path):
    return [sys.executable, "-m", "mpitrain", "sweep", "--models", "lr", "--modes",
            "sync,async", "--np", "2,3", "--set", "steps=5", "--set", f"data_dir={mnist}",
            "--results-dir", str(results)]


def kill_everything(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL the sweep, its mpirun and every rank (ranks have process groups of their own)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in arg for arg in process.info["cmdline"] or ()):
            try:
                process.kill()
            except psutil.Error:
                pass


@pytest.mark.slow
def test_tiny_sweep_resumes_after_being_killed(mnist, tmp_path):
    results = tmp_path / "sweep"
    proc = subprocess.Popen(sweep_cmd(results, mnist), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=mpi_env(), start_new_session=True)
    deadline = time.monotonic() + 300
    while sum(e["status"] == "done" for e in manifest(results).values()) < 2:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        assert time.monotonic() < deadline, "the sweep did not finish two runs"
        time.sleep(0.2)
    kill_everything(proc, str(results))
    first = {k: e for k, e in manifest(results).items() if e["status"] == "done"}
    assert len(first) == 2
    mtimes = {k: (Path(e["run_dir"]) / "curve.csv").stat().st_mtime for k, e in first.items()}

    resumed = run_bounded(sweep_cmd(results, mnist), 600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.count("done earlier, skipped") == 2
    final = manifest(results)
    assert len(final) == 4 and all(e["status"] == "done" for e in final.values())
    for key, entry in first.items():  # finished runs were not redone
        assert final[key]["run_dir"] == entry["run_dir"]
        assert (Path(entry["run_dir"]) / "curve.csv").stat().st_mtime == mtimes[key]
    ok = [r for r in read_rows(results / "runs.csv") if r["status"] == "ok"]
    assert len(ok) == 4
    assert (results / "report" / "report.md").is_file()
