"""The bad-input tier's whole runs (issue #39): every case one ``mpitrain: error:`` line
and its exit code, never a traceback or a hang, and what was written kept.

The cases run through the CLI's entry point several to a process
(tests/helpers/cli_runs.py, which prints each run's exit code): those that need no
ranks in one process at -np 1 without mpirun, those whose defect showed once per rank
or as a hang of the job in one ``mpirun -np 3``, so each process imports TensorFlow
once for all of them. The checks of each reader, model probe and writer are in-process
in tests/unit/test_bad_input.py; the launcher's refusal to restart into a full disk
and the row of a killed attempt need ``mpitrain launch``.
"""

import json
import os
import re
import sys

import numpy as np
import pytest

from conftest import (LOCAL_HOSTFILE, REPO, fill, mpi_env, mpirun_cmd, read_rows, run_bounded,
                      write_image_folder)
from unit.test_bad_input import HEAD, MODEL_FILES, lr_metadata

ERROR = "mpitrain: error: "
EAGER_ONLY = HEAD + (
    "class M(keras.Model):\n"
    "    def __init__(self, n):\n"
    "        super().__init__(); self.d = L.Dense(n)\n"
    "    def call(self, x, training=False):\n"
    "        scale = float(tf.reduce_max(x).numpy()) + 1.0  # runs eagerly, not in a step\n"
    "        return self.d(L.Flatten()(x)) / scale\n"
    "def build(input_shape, num_classes):\n    return M(num_classes)\n")


def make_inputs(d):
    """The bad files of the cases, in ``d``: {name: path}."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (200, 8, 8), dtype=np.uint8), rng.integers(0, 3, 200)
    files = {"ok": (x, y)}
    files["big_label"] = (x, np.where(np.arange(200) == 0, 10**9, y))
    files["wrapping_label"] = (x, np.where(y == 2, 2**32 + 2, y).astype(np.int64))
    files["one_class"] = (x, np.zeros(200, int))
    paths = {}
    for name, (xs, ys) in files.items():
        paths[name] = d / f"{name}.npz"
        np.savez(paths[name], x_train=xs, y_train=ys, x_test=xs[:40], y_test=y[:40] % 2
                 if name == "wrapping_label" else ys[:40] % 2 if name == "one_class" else y[:40])
    paths["fifo_folder"] = write_image_folder(d / "images", n=40, classes=2)
    os.mkfifo(paths["fifo_folder"] / "c1" / "pipe.png")
    for name in ("no_weights", "exits_in_build", "parses_arguments_at_import",
                 "nested_softmax_head"):
        paths[name] = d / f"{name}.py"
        paths[name].write_text(MODEL_FILES[name])
    paths["eager_only"] = d / "eager_only.py"
    paths["eager_only"].write_text(EAGER_ONLY)
    run = d / "edited-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**lr_metadata(1), "config": {
        **lr_metadata(1)["config"], "epochs": "many"}}))
    paths["edited_run"] = run
    return paths


def cases(p, results, np_):
    """(arguments, exit code, the error line's pattern) of each case; {r} in a pattern
    stands for 'rank 0 on HOST: ' where the ranks agreed on the error (np > 1)."""
    data = ["--steps", "3", "--results-dir", results]
    return [
        (["lr", "--data", p["fifo_folder"], "--timeout", "30", *data], 1,  # item 1
         r"{r}%s/c1/pipe.png: is a FIFO \(named pipe\), not a regular file; mpitrain "
         r"reads only regular files: replace or remove it" % re.escape(str(p["fifo_folder"]))),
        (["lr", "--data", p["big_label"], *data], 1,  # item 2
         r"{r}.*big_label.npz: y_train has labels up to 1,000,000,000 but only 4 distinct "
         r"labels; classes are 0..K-1, K at most 100,000: relabel them 0..3"),
        (["lr", "--data", p["wrapping_label"], *data], 1,  # item 3
         r"{r}.*wrapping_label.npz: y_train has labels up to 4,294,967,298 but only 3"),
        ([f"{p['no_weights']}:build", "--data", p["ok"], *data], 2,  # item 4
         r"{r}model .*no_weights.py:build: it has no trainable weights, so there is nothing "
         r"to train; build it from layers with weights \(end with Dense\(num_classes\)\)"),
        ([f"{p['exits_in_build']}:build", "--data", p["ok"], *data], 2,  # item 5
         r"{r}model .*exits_in_build.py:build: building it for input \(8, 8, 1\) and 3 "
         r"classes failed \(it called sys.exit\('bye'\) at .*exits_in_build.py line 5\)"),
        ([f"{p['parses_arguments_at_import']}:build", "--data", p["ok"], *data], 2,  # item 5
         r"{r}model .*:build: importing it failed \(it called sys.exit\(2\) after printing "
         r"'train.py: error: the following arguments are required: --foo' at .* line 8\)"),
        (["lr", "--seed", "-1", *data], 2,  # item 6
         r"--seed must be 0 or a positive integer \(got -1\)"),
        (["lr", "--timeout", "inf", *data], 2,  # item 7
         r"--timeout must be a positive number of seconds, at most 1,000,000 \(got inf\)"),
        (["lr", "--sample-interval", "inf", *data], 2,  # item 7
         r"--sample-interval must be 0 \(off\) or a number of seconds of at least 0.01, at "
         r"most 1,000,000 \(got inf\)"),
        (["lr", "--resume", p["edited_run"], "--steps", "3"], 2,  # item 10
         r"{r}--resume .*edited-run: epochs in .*edited-run/config.json must be a positive "
         r"integer \(got 'many'\); fix the file or start a new run"),
        (["alexnet", "--image-size", "60000", *data], 2,  # item 13
         r"{r}--image-size 60000, --synthetic-size 1,280: the synthetic data \(\d+ random "
         r"60000x60000x3 images and 1,536 labels\) need [0-9.]+ TiB of memory on each rank, "
         r"but .* available for its %d rank\(s\); use a smaller --image-size" % np_),
        (["lr", "--data", p["one_class"], *data], 1,  # also found: a single class
         r"{r}.*one_class.npz: every training label is 0: one class is nothing to classify"),
        ([f"{p['nested_softmax_head']}:build", "--data", p["ok"], *data], 2,  # also found
         r"{r}model .*nested_softmax_head.py:build ends in a softmax: pass --outputs "
         r"probabilities"),
        # last: the user's code failing in a training step is a rank's own error, which
        # ends the job (every case above is agreed on by every rank, which go on)
        ([f"{p['eager_only']}:build", "--data", p["ok"], *data], 2,
         r"model .*eager_only.py:build: your code failed in training \(AttributeError: "
         r"'SymbolicTensor' object has no attribute 'numpy' at .*eager_only.py line 8\)"),
    ]


def check_each(result, expected, np_):
    """Every run gave its exit code and exactly its one error line, in order."""
    lines = result.stderr.splitlines()
    errors = [line[len(ERROR):] for line in lines if line.startswith(ERROR)]
    codes = [int(c) for c in re.findall(r"^cli_runs: run \d+ exit (\d+)$", result.stderr, re.M)]
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr, result.stderr
    assert len(errors) == len(expected), "\n".join(lines)
    rank = r"rank 0 on [^:]+: " if np_ > 1 else ""
    for (argv, code, pattern), line in zip(expected, errors):
        assert re.fullmatch(pattern.replace("{r}", rank) + ".*", line), (argv, line)
    if np_ == 1:
        assert codes == [code for _, code, _ in expected], codes
    else:  # the last case ends the job: the job's code is its
        assert codes == [code for _, code, _ in expected[:-1]], codes
        assert result.returncode == expected[-1][1], result.stderr[-2000:]


def test_bad_input_in_one_process(tmp_path, tmpfs, mnist):
    """-np 1, no mpirun: the cases, then the results directory on a read-only disk, on a
    full one, and on one that fills up during the run (issue #39 items 8 and 9)."""
    inputs = make_inputs(tmp_path)
    expected = cases(inputs, tmp_path / "res", 1)
    read_only, empty, filling = tmpfs(256, read_only=True), tmpfs(256), tmpfs(512)
    fill(empty, leave_kib=0)
    fill(filling, leave_kib=100)  # the reserve, config.json, the curve; no checkpoint
    disks = [
        (read_only, "cannot write %s: read-only file system \\(EROFS\\); pass a --results-dir "
                    "on a writable file system" % read_only),
        (empty, "cannot write %s/[^:]+: no space left on the device \\(ENOSPC\\); free space "
                "there or pass another --results-dir; what was written is intact" % empty),
        (filling, "cannot write %s/[^:]+/checkpoint.npz: no space left on the device "
                  "\\(ENOSPC\\)" % filling)]
    expected[-1:-1] = [(["lr", "--data-dir", mnist, "--epochs", "3", "--results-dir", disk],
                        74, line) for disk, line in disks]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([[str(a) for a in argv] for argv, _, _ in expected]))
    result = run_bounded([sys.executable, REPO / "tests" / "helpers" / "cli_runs.py", spec,
                          "--codes"], 300, env=mpi_env())
    check_each(result, expected, 1)
    # the run the disk filled under: recorded as failed, not restartable, files intact
    run_dir, = [p for p in filling.iterdir() if p.is_dir()]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["restartable"]) == ("failed", False)
    row, = read_rows(filling / "runs.csv")
    assert row["status"] == "failed" and "no space left on the device" in row["reason"]
    assert [r["step"] for r in read_rows(run_dir / "curve.csv")][0] == "0"
    json.loads((run_dir / "config.json").read_text())  # whole
    assert [p.name for p in empty.iterdir()] == ["filler"]  # no empty run directory left


@pytest.mark.slow  # the quick tier keeps the same cases in one process
def test_bad_input_under_mpirun(tmp_path):
    """-np 3: the defects that showed once per rank (tracebacks, raw SystemExit text,
    out-of-memory on every rank) or as a hang of the whole job are one line, printed once,
    in one launch."""
    inputs = make_inputs(tmp_path)
    expected = cases(inputs, tmp_path / "res", 3)
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([[str(a) for a in argv] for argv, _, _ in expected]))
    result = run_bounded(mpirun_cmd(3, REPO / "tests" / "helpers" / "cli_runs.py", spec,
                                    "--codes", module=None), 600)
    check_each(result, expected, 3)


def test_an_error_under_enable_recovery_is_a_failed_job(tmp_path):
    """Open MPI 4's mpirun --enable-recovery (async training's, for lost workers) exits 0
    whatever its ranks return: an error every rank raised (here a missing data
    directory) ended the job with 0. Rank 0 now ends it through mpirun: exit 1."""
    result = run_bounded(mpirun_cmd(3, "lr", "--async", "--data-dir", tmp_path / "nowhere",
                                    "--dataset", "mnist", "--results-dir", tmp_path,
                                    flags=["--enable-recovery"]), 120)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1 and "nowhere: no such directory" in lines[0], result.stderr


def test_a_call_past_its_bound_fails_the_job_under_enable_recovery():
    """Open MPI 4's mpirun --enable-recovery exits 0 whatever its ranks return: a bound
    that ended every rank (exit 1 each) ended the job with 0. The rank now ends the job
    through mpirun, which exits 1. (No MPI call: the bound is the process's own.)"""
    code = ("import time\n"
            "from mpitrain.comm.waiting import blocking_call_bound\n"
            "with blocking_call_bound(1, 'a test call'):\n"
            "    time.sleep(60)\n")
    done = run_bounded(mpirun_cmd(2, "-c", code, module=None, flags=["--enable-recovery"]),
                       120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "waited 1 s for a test call" in done.stderr


@pytest.mark.slow
def test_launch_does_not_restart_into_a_full_disk(tmp_path, tmpfs, mnist):
    """An async run under mpitrain launch (--enable-recovery: the job ends through
    mpirun, whose exit code is not the run's) whose disk fills up: one line, the run
    recorded failed and not restartable, and the launcher gives up at once (74)."""
    disk = tmpfs(512)
    fill(disk, leave_kib=150)
    result = run_bounded([sys.executable, "-m", "mpitrain", "launch", "-np", "3", "-hostfile",
                          LOCAL_HOSTFILE, "--max-restarts", "3", "lr", "--async", "--epochs",
                          "10", "--data-dir", mnist, "--results-dir", disk, "--quiet"], 600)
    assert result.returncode == 74, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1 and "no space left on the device (ENOSPC)" in lines[0], lines
    assert "a restart would fail the same way; giving up" in result.stderr
    assert result.stderr.count("mpitrain launch: $ ") == 1  # no second attempt
    run_dir, = [p for p in disk.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "status.json").read_text())["restartable"] is False
    assert read_rows(disk / "runs.csv")[0]["status"] == "failed"
