"""mpitrain.horovod under real mpirun: the same numbers as real Horovod where Horovod
works, working where it does not (Keras 3), and every bad use ending the job with one
line instead of a hang. (Every call at -np 1..4: tests/mpi/test_horovod_api.py, in the
MPI tier's launches.)

The comparison runs in .venv-horovod (TensorFlow 2.18.1, Horovod 0.28.1 built by
setup.sh): one script (tests/helpers/hvd_equivalence.py) runs the same calls with
each API, one after the other in one launch.
"""

import json
import re
import sys
import time

import numpy as np
import pytest

from conftest import (REPO, discovery_script, finish_bounded, horovod_python, mpi_env,
                      mpirun_cmd, read_rows, run_bounded, start_bounded, wait_while_running)

HELPERS = REPO / "tests" / "helpers"


def run_script(np_, script, *args, python=None, timeout=300, **env):
    kw = {"python": python} if python else {}
    return run_bounded(mpirun_cmd(np_, HELPERS / script, *args, module=None, **kw), timeout,
                       env=mpi_env(**env))


@pytest.mark.slow  # two launches of TensorFlow 2.18 and Horovod: the whole suite's
@pytest.mark.parametrize("np_", [2, 3])
def test_the_same_numbers_as_horovod_and_keras_3_where_horovod_fails(tmp_path, np_):
    """A plain-tf.Variable model trained 20 steps (DistributedGradientTape, SGD in
    tf.function, the averaged loss each step) and the collectives on fixed values:
    at -np 2 (a sum of two is one addition: the same order) bit for bit Horovod's; at
    -np 3, within float32 rounding (measured: bit for bit too, but float64 1 ulp and
    float16, which Horovod sums in float16). Keras 3: Horovod's tape and fit raise,
    ours train, every rank ending with the same weights (checked at -np 2)."""
    keras_too = [] if np_ == 2 else ["--no-keras"]  # (the Keras paths once)
    # Horovod's ranks wait in MPI calls that spin; told to yield where ranks outnumber
    # cores, they leave the cores to the other tests' launches (the numbers are the same)
    result = run_script(np_, "hvd_equivalence.py", "--out", tmp_path / "got", *keras_too,
                        python=horovod_python(), OMPI_MCA_mpi_yield_when_idle=1)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs, ours = (np.load(tmp_path / f"got-{api}.npz") for api in ("horovod", "mpitrain"))
    keras_paths = json.loads((tmp_path / "got.json").read_text())
    assert set(theirs.files) == set(ours.files)
    for key in theirs.files:
        if key == "fp16_gradients":  # float16 sums: pairwise in float16 (Horovod), in float32
            np.testing.assert_allclose(ours[key], theirs[key], rtol=3e-2, atol=2e-4)
        elif np_ == 2:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
        else:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-6,
                                       err_msg=key)
    assert np.all(np.diff(ours["losses"][:3]) != 0)  # a real curve, not a constant
    if keras_too:
        return
    their_keras, our_keras = keras_paths["horovod"], keras_paths["mpitrain"]
    for path in ("tape", "fit"):
        assert not their_keras[path]["ok"] and "ref" in their_keras[path]["error"], their_keras
        assert our_keras[path]["ok"], our_keras
    assert our_keras["fit"]["same_weights_everywhere"]
    losses = our_keras["fit"]["loss"]
    assert losses[-1] < losses[0]


def errors(result):
    return [line for line in result.stderr.splitlines() if line.startswith("mpitrain: error:")]


def test_a_call_before_init_is_one_line():
    result = run_bounded([sys.executable, HELPERS / "hvd_bad_use.py", "before_init"], 120,
                         env=mpi_env())
    assert result.returncode == 2
    assert errors(result) == ["mpitrain: error: mpitrain.horovod has not been initialized; "
                              "call hvd.init() first (on every rank)"], result.stderr[-2000:]


# (slow: the quick tier's MPI tier has the mismatches outside tf.function)
@pytest.mark.slow
def test_ranks_that_disagree_inside_tf_function_stop_with_one_line():
    result = run_script(2, "hvd_bad_use.py", "mismatch")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = errors(result)
    assert re.fullmatch(
        r"mpitrain: error: the ranks disagree at collective #2: rank 0 on \S+: allreduce "
        r"Average float32 \(2, 4\); rank 1 on \S+: allreduce Average float32 \(4, 2\); "
        r"every rank must make the same collective calls, with the same shapes, dtypes and "
        r"names, in the same order", line), line
    assert "was not stopped" not in result.stdout


@pytest.mark.slow  # waits out a --timeout by design
def test_a_stalled_rank_is_named_within_the_timeout():
    # ranks 0 and 1 both wait for rank 2: the line is printed once, by rank 0
    began = time.monotonic()
    result = run_script(3, "hvd_bad_use.py", "stalled", MPITRAIN_TIMEOUT="5")
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = errors(result)
    assert line.startswith("mpitrain: error: rank 0 on ") and " waited 5 s for rank 2 on " in line
    assert "to reach collective #2 (allreduce Average float32 (3,)): it is stalled" in line
    assert time.monotonic() - began < 120


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dies", "raises", "rank0_exits"])
def test_a_rank_that_dies_or_raises_ends_the_job(case):
    # the job's end must come from the rank's exit, not from the survivor waiting out its
    # timeout: a timeout far beyond any start-up on a loaded machine, and its message absent
    began = time.monotonic()
    result = run_script(2, "hvd_bad_use.py", case, timeout=500, MPITRAIN_TIMEOUT="400")
    assert result.returncode != 0 and "was not stopped" not in result.stdout
    assert " waited 400 s " not in result.stderr
    assert time.monotonic() - began < 400
    if case == "raises":
        assert "RuntimeError: a bug on one rank" in result.stderr
        assert "mpitrain: rank 1 raised the exception above; ending the job" in result.stderr
    if case == "rank0_exits":  # its exit announced: the others stop at their next call,
        # printed once (by rank 1: rank 0 has left), the usage error's code
        assert result.returncode == 2
        (line,) = errors(result)
        assert re.fullmatch(r"mpitrain: error: the ranks disagree at collective #2: rank 0 on "
                            r"\S+: left the job \(its script ended or called sys.exit\); "
                            r"rank 1 on \S+: allreduce Average float32 \(3,\); .*", line), line


#: runs several scripts one after another in one process, each as ``python SCRIPT ARGS``
RUN_SCRIPTS = ("import json, runpy, sys\n"
               "for argv in json.loads(sys.argv[1]):\n"
               "    sys.argv = argv\n"
               "    runpy.run_path(argv[0], run_name='__main__')\n")


@pytest.mark.slow
def test_the_examples_train_and_resume(tmp_path):
    """examples/keras_fit.py (model.fit, the callbacks, rank 0's checkpoints) for an
    epoch, then again for two: the second resumes from the first's checkpoint, which
    rank 0 had just written (the other ranks take its word: they must not read a file
    it may still be writing), passing over a newer one cut short as by a kill; then
    examples/horovod_loop.py (Horovod's custom loop); then keras_fit.py on the same
    data packed as a shard set (mpitrain.stream_shards). One launch at -np 3 on an npz
    of the real MNIST."""
    from conftest import mnist_dir
    from mpitrain.data import sources

    npz = tmp_path / "mnist.npz"
    np.savez(npz, **sources.read_mnist_dir(mnist_dir()))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "epoch-009.keras").write_bytes(b"PK\x03\x04 half a zip")
    fit = [str(REPO / "examples" / "keras_fit.py"), str(npz), "--steps", "30",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    shards = tmp_path / "shards"  # the same data as a shard set, streamed by each rank
    packed = run_bounded([sys.executable, "-m", "mpitrain", "data", "pack", npz, shards], 300)
    assert packed.returncode == 0, packed.stderr
    runs = [fit + ["--epochs", "1"], fit + ["--epochs", "2"],
            [str(REPO / "examples" / "horovod_loop.py"), str(npz), "--steps", "60"],
            [str(REPO / "examples" / "keras_fit.py"), str(shards), "--steps", "30"]]
    result = run_bounded(mpirun_cmd(3, "-c", RUN_SCRIPTS, json.dumps(runs), module=None), 900,
                         env=mpi_env())
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    accuracies = [float(line.split()[2].rstrip(",")) for line in out.splitlines()
                  if line.startswith("test accuracy")]  # rank 0 alone prints them
    assert len(accuracies) == 4 and min(accuracies) > 0.8, out
    # the second fit trained epoch 2 only (Keras prints "Epoch N/M" when M > 1)
    assert "after epoch 1 on 3" in out and "Epoch 1/2" not in out and "Epoch 2/2" in out, out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch-001.keras", "epoch-002.keras", "epoch-009.keras"]


@pytest.mark.slow
def test_launch_restarts_a_script_which_resumes_and_writes_telemetry(tmp_path):
    """``mpitrain launch -np 2 SCRIPT.py``: the first attempt fails in epoch 2 (a rank
    raises), the launcher starts the script again, which resumes from its own epoch-1
    checkpoint; with $MPITRAIN_RESULTS_DIR each attempt also writes mpitrain's
    telemetry, and ``mpitrain report`` plots the finished one."""
    results = tmp_path / "results"
    result = run_bounded([sys.executable, "-m", "mpitrain", "launch", "-np", "2",
                          "--max-restarts", "2", HELPERS / "hvd_fit_fails_once.py",
                          tmp_path / "ckpt"], 900,
                         env=mpi_env(MPITRAIN_RESULTS_DIR=results))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RuntimeError: an injected failure in epoch 2" in result.stderr
    assert "restarting the script (it resumes from its own checkpoints)" in result.stderr
    assert "the run finished after 1 restart(s)" in result.stderr
    assert result.stdout.count("trained epochs 2 to 2") == 1, result.stdout
    rows = read_rows(results / "runs.csv")  # each attempt keeps its row (the failed one's
    # written by the launcher: rank 0 was killed when the job ended)
    assert [(r["engine"], r["status"], r["np"]) for r in rows] == [
        ("mpitrain.horovod", "failed", "2"), ("mpitrain.horovod", "ok", "2")], rows
    run = results / rows[1]["run"]
    assert rows[1]["run"].endswith("hvd_fit_fails_once-horovod-np2")
    assert json.loads((run / "status.json").read_text())["launch_attempt"]
    curve = read_rows(run / "curve.csv")  # the resumed attempt trained epoch 2
    assert [row["epoch"] for row in curve] == ["2"] and float(curve[0]["train_loss"]) > 0
    timing = read_rows(run / "timing.csv")
    assert sorted(row["rank"] for row in timing) == ["0", "1"]
    assert all(float(row["comm_s"]) + float(row["wait_s"]) > 0 for row in timing)
    kinds = {(row["rank"], row["kind"]) for row in read_rows(run / "comm.csv")}
    assert {("0", "allreduce"), ("1", "allreduce"), ("0", "broadcast")} <= kinds
    assert {row["rank"] for row in read_rows(run / "telemetry.csv")} == {"0", "1"}
    report = run_bounded([sys.executable, "-m", "mpitrain", "report", results], 300)
    assert report.returncode == 0, report.stderr
    assert (run / "fig-time-breakdown.png").stat().st_size > 0


@pytest.mark.slow
def test_launch_grows_a_horovod_elastic_script(tmp_path):
    """A Horovod elastic loop (tests/helpers/hvd_elastic.py: hvd.elastic.run,
    TensorFlowKerasState, a commit every 10 batches, a reset callback scaling the
    learning rate) under ``mpitrain launch -np 2:3 --host-discovery-script S``. S lists
    this host with 2 slots, then, once the script has written its elastic state, with
    3: the launcher stops the job, every rank at the same commit (exit 143, the state
    written), and restarts it at -np 3; the state resumes from that commit, the reset
    callback runs once at the new size, and training ends at the same batch count on
    every rank with the same weights."""
    listing, script = discovery_script(tmp_path, "localhost:2\n")
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    proc = start_bounded([sys.executable, "-m", "mpitrain", "launch", "-np", "2:3",
                          "--host-discovery-script", script, HELPERS / "hvd_elastic.py", out,
                          "400"], env=mpi_env(MPITRAIN_RESULTS_DIR=results,
                                              MPITRAIN_ELASTIC_PERSIST_EVERY="0"))
    wait_while_running(proc, lambda: list(results.glob("elastic-state-*.pkl")))
    listing.write_text("localhost:3\n")
    done = finish_bounded(proc, 600)

    assert done.returncode == 0, done.stderr[-3000:]
    print("\n".join(line for line in done.stderr.splitlines() if "mpitrain" in line))
    assert "the hosts offer 3 slot(s), the job runs on 2: stopping the job at a " \
        "checkpoint" in done.stderr, done.stderr[-3000:]
    assert "mpitrain.horovod: stopped at a commit, the elastic state written" in done.stderr
    assert "-np 2 -> 3, the run resumes with more workers" in done.stderr
    assert "mpitrain.horovod: the elastic state resumed from" in done.stderr
    attempts = [line.split() for line in (out / "attempts").read_text().splitlines()]
    assert [size for size, _ in attempts] == ["2", "3"] and attempts[0][1] == "0"
    resumed_at = int(attempts[1][1])
    assert 0 < resumed_at < 400 and resumed_at % 10 == 0, attempts  # at a commit
    final = json.loads((out / "final.json").read_text())
    assert (final["size"], final["batch"], final["resets"]) == (3, 400, [3])
    assert final["lr"] == pytest.approx(0.03) and final["same_weights"]
    assert final["loss"] < 1.0  # it trained (a linear fit of 64 points)
    assert not list(results.glob("elastic-state-*.pkl"))  # it lives as long as the launch
