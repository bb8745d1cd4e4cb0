"""End-to-end: the CLI under real mpirun, smoke runs and every bad input.

Each bad input must give one clear line, a non-zero exit, and no hang (every
launch is bounded by run_bounded's timeout, which fails the test if it hangs).
"""

import json
import sys

import psutil
import pytest

from conftest import mnist_shard, mpirun, read_rows
from unit.test_data import write_mnist


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("mpitrain: error")]


# -np 4 (oversubscribed) in the whole suite: the quick tier's largest launch
@pytest.mark.parametrize("np_", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_dry_run_writes_results(np_, shared_run):
    run_dir, run, stdout = shared_run(np_, "dry")
    mode = "single" if np_ == 1 else "sync"
    assert (run["model"], run["mode"], run["np"], run["workers"]) == (
        "lr", mode, str(np_), str(max(1, np_ - 1)))
    assert run["steps"] == "2" and run["dataset"] == "mnist" and run["status"] == "ok"
    assert 0.0 < float(run["test_accuracy"]) <= 1.0
    assert len(read_rows(run_dir.parent / "runs.csv")) == 1
    curve = read_rows(run_dir / "curve.csv")
    assert [row["step"] for row in curve] == ["0", "2"]
    meta = json.loads((run_dir / "config.json").read_text())
    assert len(meta["ranks"]) == np_ and meta["config"]["mode"] == mode
    # the sync server shares this host with the workers: it served at the lowest
    # priority, running only when they leave a core free (mpitrain/train/priority.py)
    assert run.get("server_nice") == (None if np_ == 1 else "19")
    assert meta["versions"]["tensorflow"].startswith("2.")
    assert "Open MPI" in meta["versions"]["mpi_library"]
    assert f"results: {run_dir}" in stdout


def test_console_script_and_steps(mnist, tmp_path):
    result = mpirun(2, "lr", "--steps", "5", "--data-dir", mnist, "--results-dir", tmp_path,
                    "--quiet", "--eval-every", "1")
    assert result.returncode == 0, result.stderr
    assert read_rows(tmp_path / "runs.csv")[0]["steps"] == "5"
    assert "epoch" not in result.stdout.split("done:")[0]  # --quiet: no progress lines


# ---- bad input: one line, non-zero exit, never a hang --------------------------------
# the quick tier: argparse's refusal and the config's; the config's others under mpirun
# in the slow tier (in process: tests/unit/test_config.py, test_bad_input.py)
@pytest.mark.parametrize("args,pattern", [
    (["nosuchmodel"], "invalid choice: 'nosuchmodel'"),
    (["lr", "--batch-size", "0"], "--batch-size must be a positive integer"),
    pytest.param(["lr", "--batch-size", "-5"], "--batch-size must be a positive integer",
                 marks=pytest.mark.slow),
    pytest.param(["lr", "--epochs", "0"], "--epochs must be a positive integer",
                 marks=pytest.mark.slow),
    pytest.param(["lr", "--epochs", "-1"], "--epochs must be a positive integer",
                 marks=pytest.mark.slow),
])
def test_usage_errors_print_once_exit_2(args, pattern):
    result = mpirun(4, *args, timeout=60)
    assert result.returncode == 2
    lines = error_lines(result)
    assert len(lines) == 1 and pattern in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_async_needs_two_ranks():
    result = mpirun(1, "lr", "--async", timeout=60)
    assert result.returncode == 2
    assert "--async needs a parameter server and at least one worker" in error_lines(result)[0]


def test_batch_larger_than_shard(mnist, tmp_path):
    shard = mnist_shard(3)
    result = mpirun(4, "lr", "--batch-size", str(shard + 1), "--data-dir", mnist,
                    "--results-dir", tmp_path, timeout=120)
    assert result.returncode == 2
    lines = error_lines(result)
    assert len(lines) == 1 and f"larger than a worker's shard ({shard} examples" in lines[0]
    assert not (tmp_path / "runs.csv").exists()


def test_workers_without_data(tmp_path):
    tiny = write_mnist(tmp_path / "tiny", n_train=2, n_test=5)
    result = mpirun(4, "lr", "--batch-size", "1", "--data-dir", tiny,
                    "--results-dir", tmp_path / "res", timeout=120)
    assert result.returncode == 2
    assert "every worker would get no data" in error_lines(result)[0]


def test_missing_data_dir(tmp_path):
    result = mpirun(3, "lr", "--data-dir", tmp_path / "nowhere", timeout=120)
    assert result.returncode == 1
    lines = error_lines(result)
    assert len(lines) == 1 and "nowhere: no such directory" in lines[0]


def test_corrupt_idx_file(tmp_path, mnist):
    bad = write_mnist(tmp_path / "bad", n_train=100, n_test=10)
    victim = bad / "train-images-idx3-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:300])
    result = mpirun(3, "lr", "--data-dir", bad, "--results-dir", tmp_path / "res", timeout=120)
    assert result.returncode == 1
    lines = error_lines(result)
    assert len(lines) == 1
    assert "train-images-idx3-ubyte.gz: cannot read" in lines[0] and "rank 1 on" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_offline_auto_falls_back_to_digits(tmp_path):
    env_args = dict(HOME=tmp_path, MPITRAIN_MNIST_URL="http://127.0.0.1:9/mnist.npz")
    from conftest import mpi_env

    result = mpirun(2, "lr", "--dry-run", "--results-dir", tmp_path / "res",
                    env=mpi_env(**env_args), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "note: MNIST not found and the download failed" in result.stdout
    assert read_rows(tmp_path / "res" / "runs.csv")[0]["dataset"] == "digits"
    strict = mpirun(2, "lr", "--dataset", "mnist", "--results-dir", tmp_path / "res",
                    env=mpi_env(**env_args), timeout=120)
    assert strict.returncode == 1
    assert "--data-dir DIR or $MPITRAIN_DATA_DIR" in error_lines(strict)[0]


@pytest.mark.parametrize("how", ["exits before it", "stopped before it"])
def test_a_rank_that_never_starts_mpi_ends_the_job(tmp_path, how):
    """Rank 2 of 3 never reaches MPI_Init: a wrapper script ends it first (exit status 0),
    or it is stopped first (as by an import from a stalled file system). Without a bound
    the other two would wait in MPI_Init forever; past --start-timeout rank 0 says so,
    once, and the job ends with nothing left running."""
    never = "exit 0" if how == "exits before it" else "kill -STOP $$"
    wrapper = tmp_path / "rank.sh"
    wrapper.write_text(f'[ "$OMPI_COMM_WORLD_RANK" = 2 ] && {never}\n'
                       f'exec {sys.executable} -m mpitrain "$@"\n')
    result = mpirun(3, wrapper, "lr", "--dry-run", "--start-timeout", "3", "--results-dir",
                    tmp_path / "res", python="sh", module=None, timeout=60)
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert "rank 0 on" in lines[0] and "waited 3 s for every rank of the job to start MPI" \
        in lines[0] and "--start-timeout" in lines[0]
    left = [p for p in psutil.process_iter(["cmdline", "status"])
            if str(wrapper) in " ".join(p.info["cmdline"] or [])
            and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert not left, left


# ---- acceptance: accuracy on the real MNIST -------------------------------------------
@pytest.mark.slow
def test_sync_accuracy_matches_single_node(lr_accuracy):
    """Single-node LR >= 91%; sync at -np 2/3/4 within 0.5 pp at the same epochs."""
    accuracy = {np_: lr_accuracy(np_) for np_ in (1, 2, 3, 4)}
    print("LR test accuracy by -np:", accuracy)
    assert accuracy[1] >= 0.91
    for np_ in (2, 3, 4):
        assert abs(accuracy[np_] - accuracy[1]) <= 0.005, accuracy
