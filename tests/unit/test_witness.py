"""The run's witness (mpitrain/results/witness.py) with real processes: a rank 0 that dies
of a signal while its run trains is recorded as failed, with its runs.csv row; one that
recorded its end is left as it wrote it; under ``mpitrain launch`` no witness starts
(the launcher records). The same under real mpirun: tests/e2e/test_faults.py's killed
ranks."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, read_rows, status_once_ended
from mpitrain.results import lost_run
from mpitrain.results.run_dir import ATTEMPT_ENV
from unit.test_bad_input import lr_metadata

#: rank 0 without MPI: opens a run, says running (the witness starts), then records
#: ``END`` (if not "none") and waits to be killed, or exits
RANK0 = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from mpitrain.results.run_dir import RunResults, attempt_facts
    results_dir, end, config = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    results = RunResults(results_dir, "lr-sync-np3")
    results.write_json("config.json", config)
    results.set_status("running", **attempt_facts())
    if end != "none":
        results.add_run_row({"run": results.dir.name, "status": end})
        results.set_status(end)
    print(results.dir, flush=True)
    time.sleep(60 if end == "none" else 0)
""")


def rank0(tmp_path, end, metadata, env=None):
    proc = subprocess.Popen([sys.executable, "-c", RANK0, str(tmp_path), end,
                             json.dumps(metadata)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, **(env or {})})
    run_dir = proc.stdout.readline().strip()
    assert run_dir, "rank 0 did not start"
    return proc, tmp_path / os.path.basename(run_dir)


@pytest.mark.parametrize("metadata", [lr_metadata(), {  # a script's, under mpitrain.horovod
    "config": {"model": "train", "mode": "sync", "world_size": 2, "workers": 2,
               "engine": "mpitrain-horovod", "timeout": 30}}], ids=["cli", "horovod"])
def test_a_rank_0_killed_while_training_is_recorded_failed(tmp_path, metadata):
    proc, run_dir = rank0(tmp_path, "none", metadata)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    status = status_once_ended(run_dir)
    assert (status["status"], status["reason"], status["runs_csv"]) == (
        "failed", lost_run.REASON, "written")
    row, = read_rows(tmp_path / "runs.csv")
    assert (row["run"], row["model"], row["np"], row["status"], row["reason"]) == (
        run_dir.name, metadata["config"]["model"], str(metadata["config"]["world_size"]),
        "failed", lost_run.REASON)


def test_a_run_that_recorded_its_end_is_left_as_it_was(tmp_path):
    proc, run_dir = rank0(tmp_path, "ok", lr_metadata())
    assert proc.wait(timeout=30) == 0
    time.sleep(1.5)  # the witness has seen rank 0's exit and looked at the run
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    assert [row["status"] for row in read_rows(tmp_path / "runs.csv")] == ["ok"]


def test_the_launcher_records_its_attempts_itself(tmp_path):
    proc, run_dir = rank0(tmp_path, "none", lr_metadata(), env={ATTEMPT_ENV: "t1"})
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    time.sleep(1.5)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"
    assert not (tmp_path / "runs.csv").exists()


def test_a_run_recorded_in_process_dismisses_its_witness(tmp_path):
    """A process may train many runs (mpitrain.fit in a loop): each run's witness leaves
    when the run has recorded its end, not when the process exits."""
    from mpitrain.results.run_dir import RunResults

    results = RunResults(tmp_path, "lr-sync-np3")
    results.write_json("config.json", lr_metadata())
    results.set_status("running")
    process = results._witness.process
    assert process.poll() is None
    results.add_run_row({"run": results.dir.name, "status": "ok"})
    results.set_status("ok")
    assert process.wait(timeout=30) == 0
    assert [row["status"] for row in read_rows(tmp_path / "runs.csv")] == ["ok"]
