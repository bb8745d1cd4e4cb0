"""The engine benchmarks compare like with like: the same algorithm options on both
sides, and a target judged only between engines on the same TensorFlow."""

from bench.async_engines import CASES as ASYNC_CASES
from bench.engines import CASES, WORKERS, engine_checks


def options(args):
    """{option: value} of a command line of --option value pairs."""
    return dict(zip(args[::2], args[1::2]))


def test_both_sides_get_the_same_algorithm_and_the_rate_mpitrain_ends_up_with():
    for cases, scale in ((CASES, WORKERS), (ASYNC_CASES, 1)):
        for model, (ours, theirs) in cases.items():
            ours, theirs = options(ours), options(theirs)
            assert {k: v for k, v in ours.items() if k != "--lr"} == \
                {k: v for k, v in theirs.items() if k != "--lr"}, model
            assert float(theirs["--lr"]) == float(ours["--lr"]) * scale, model
            assert {"--optimizer", "--lr-schedule", "--epochs", "--batch-size"} <= set(ours)


def run(tensorflow, seconds=1.0, accuracy=0.9):
    return {"epoch_time_s": seconds, "compute_epoch_s": seconds / 2,
            "test_accuracy": accuracy, "tensorflow": tensorflow}


def test_only_engines_on_one_tensorflow_are_judged():
    measured = {"mpi": run("2.21.0", 2.0), "mpi-horovod-env": run("2.18.1", 3.0),
                "horovod": run("2.18.1", 4.0), "mwms": run("2.21.0", 2.5)}
    checks = {c["ratio"]: c for c in engine_checks("lr", measured, quick=False)}
    same = checks["lr: mpi / horovod epoch time (same TensorFlow, 2.18.1)"]
    assert (same["value"], same["met"], same["target"]) == (0.75, False, "<= 0.6")
    own = checks["lr: mpi / horovod epoch time (each on its own stack: TensorFlow 2.21.0 / "
                 "2.18.1)"]
    assert (own["value"], own["met"], own["target"]) == (0.5, None, "reported")
    mwms = checks["lr: mpi / mwms epoch time (same TensorFlow, 2.21.0)"]
    assert (mwms["value"], mwms["met"]) == (0.8, True)
    judged = [c for c in checks.values() if c["met"] is not None]
    assert all("same TensorFlow" in c["ratio"] for c in judged)
    assert len(judged) == 4  # the two epoch-time targets and the two accuracy targets
