"""The batch scripts in jobs/ under a real slurmctld/slurmd on this host.

scripts/slurm-local brings up Debian's Slurm (installing it if missing); the
tests are skipped, with the reason, only where the packages cannot be installed.
Each job script is submitted with sbatch, its node count overridden to fit one
host, waited for with a bound, and its results checked.
"""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, mpi_env, read_rows, rows_so_far, run_bounded

# Load beside them cannot change an outcome: the job runs are bounded by minutes
# (--time, Job.finish) against seconds of work, and the scancel lands while training
# is under way (500 epochs).
pytestmark = pytest.mark.slow
SLURM = REPO / "scripts" / "slurm-local"
# three tasks: a server and two workers, the fewest that average gradients
ONE_HOST = ["--nodes=1", "--ntasks=3", "--ntasks-per-node=3"]


@pytest.fixture(scope="module")
def slurm():
    up = run_bounded([SLURM, "up"], 300)
    if up.returncode != 0:
        text = up.stdout + up.stderr
        if "apt-get" in text and ("Unable to locate" in text or "Could not resolve" in text):
            pytest.skip("Slurm packages cannot be installed here: " + text.strip()[-300:])
        pytest.fail("scripts/slurm-local up failed:\n" + text[-3000:])
    yield
    run_bounded([SLURM, "down"], 120)


def job_env(tmp_path, mnist, args=""):
    return mpi_env(MPITRAIN_HOME=REPO, MPITRAIN_RESULTS=tmp_path / "results",
                   MPITRAIN_DATA_DIR=mnist, MPITRAIN_ARGS=args)


class Job:
    """A submitted batch job, polled every 0.5 s (sbatch --wait backs off to 10 s
    between polls, which cost each test ~20 s of idle waiting)."""

    DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE")

    def __init__(self, job_id: str, log: Path):
        self.id, self.log = job_id, log

    def poll(self):
        """The job's exit code once it has finished, else None."""
        out = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True,
                             text=True, timeout=30).stdout
        state = re.search(r"JobState=(\S+)", out)
        if not state or state.group(1) not in self.DONE:
            return None
        return int(re.search(r"ExitCode=(\d+):(\d+)", out).group(1))

    def finish(self, bound=600):
        deadline = time.monotonic() + bound
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                subprocess.run(["scancel", self.id], timeout=30)
                pytest.fail(f"job {self.id} still running after {bound} s")
            time.sleep(0.5)
        return code

    def output(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else "no job output"


def submit(script, tmp_path, env, *extra) -> Job:
    out = tmp_path / "job-%j.out"
    job_id = subprocess.run(["sbatch", "--parsable", *ONE_HOST, f"--output={out}",
                             REPO / "jobs" / script, *extra], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=60, check=True).stdout.strip()
    return Job(job_id, Path(str(out).replace("%j", job_id)))


@pytest.mark.parametrize("script,args,model,mode", [
    ("lr-sync.sbatch", "--steps 3", "lr", "sync"),
    ("lr-async.sbatch", "--steps 3", "lr", "async"),
    ("lenet.sbatch", "--steps 3", "lenet", "sync"),
    ("alexnet.sbatch", "--steps 2 --image-size 32", "alexnet", "sync"),
])
def test_job_scripts_complete(slurm, tmp_path, mnist, script, args, model, mode):
    """Each script as it is; the async one under `mpitrain launch -np 2:3`, which takes its
    hosts from the allocation (the node, with its 3 tasks) and runs on those that answer
    (mpirun with a hostfile of them); the others let mpirun read the allocation."""
    env = job_env(tmp_path, mnist, args)
    if mode == "async":
        env["MPITRAIN_LAUNCH_ARGS"] = "-np 2:3"
    job = submit(script, tmp_path, env)
    assert job.finish() == 0, job.output()
    job_id = job.id
    run = read_rows(tmp_path / "results" / "runs.csv")[-1]
    assert (run["model"], run["mode"], run["np"], run["status"]) == (model, mode, "3", "ok")
    assert run["slurm_job_id"] == job_id
    meta = json.loads((tmp_path / "results" / run["run"] / "config.json").read_text())
    assert meta["slurm_job_id"] == job_id
    launched = tmp_path / "results" / "hostfile.launch"
    assert launched.exists() == (mode == "async"), job.output()
    if mode == "async":
        node = subprocess.run(["scontrol", "show", "hostnames", meta["ranks"][0]["host"]],
                              capture_output=True, text=True, timeout=30).stdout.split()
        assert launched.read_text().split() == [*node, "slots=3"], job.output()


def test_job_script_under_srun(slurm, tmp_path, mnist):
    """MPITRAIN_LAUNCHER=srun: the job's tasks are the ranks, started by srun with the MPI
    plugin of the MPI that .venv's mpi4py loads (Open MPI 4.1: pmix), nothing printed
    besides the run's own lines."""
    env = job_env(tmp_path, mnist, "--steps 3")
    env["MPITRAIN_LAUNCHER"] = "srun"
    job = submit("lr-sync.sbatch", tmp_path, env)
    assert job.finish() == 0, job.output()
    run = read_rows(tmp_path / "results" / "runs.csv")[-1]
    assert (run["np"], run["status"], run["slurm_job_id"]) == ("3", "ok", job.id)
    ranks = json.loads((tmp_path / "results" / run["run"] / "config.json").read_text())["ranks"]
    assert [r["launcher"] for r in ranks] == ["srun"] * 3, ranks
    assert all(line.startswith(("dataset ", "lr sync ", "epoch ", "progress: ", "done: ",
                                "results: ")) for line in job.log.read_text().splitlines()
               if line.strip()), job.output()


def test_sweep_job(slurm, tmp_path, mnist):
    spec = tmp_path / "tiny.toml"
    spec.write_text('name = "tiny"\n[grid]\nmodel = ["lr"]\nmode = ["sync", "async"]\n'
                    'np = [3]\n[options]\nsteps = 3\n')
    env = job_env(tmp_path, mnist)
    env["SPEC"] = str(spec)
    job = submit("sweep.sbatch", tmp_path, env)
    assert job.finish() == 0, job.output()
    manifest = json.loads((tmp_path / "results" / "sweep-tiny" / "manifest.json").read_text())
    assert [e["status"] for e in manifest["runs"].values()] == ["done", "done"]
    assert (tmp_path / "results" / "sweep-tiny" / "report" / "report.md").is_file()


def test_scancel_stops_cleanly_with_a_checkpoint(slurm, tmp_path, mnist):
    job = submit("lr-sync.sbatch", tmp_path, job_env(tmp_path, mnist, "--epochs 500"))
    deadline = time.monotonic() + 300
    while True:  # wait until training is under way
        runs = [d for d in (tmp_path / "results").glob("*-lr-sync-np3")]
        if runs and len(rows_so_far(runs[0] / "curve.csv")) >= 3:
            break
        assert job.poll() is None and time.monotonic() < deadline, "job did not start"
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job.id], check=True)
    assert job.finish(bound=120) == 143, job.output()
    run = read_rows(tmp_path / "results" / "runs.csv")[-1]
    assert run["status"] == "interrupted" and run["slurm_job_id"] == job.id
    assert (runs[0] / "checkpoint.npz").is_file()
    assert "mpitrain: interrupted: stopped by SIGUSR1" in job.log.read_text()
