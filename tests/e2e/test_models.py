"""Every CNN in the registry trains a few steps in sync and in async mode under
real mpirun -np 3 (LR is covered by the CLI tests). A sync run fails if the
replicas' weight checksums ever differ at an evaluation, so "ok" also means
the replicas stayed identical."""

import pytest

from conftest import in_one_launch, read_rows

pytestmark = pytest.mark.slow


ALEXNET_SMALL = ["--image-size", "32", "--synthetic-size", "256"]


# LeNet sync with the MPI engine also runs in test_horovod.py's equivalence test
RUNS = [("lenet", [], "async"), ("alexnet", ALEXNET_SMALL, "sync"),
        ("alexnet", ALEXNET_SMALL, "async")]


def test_models_train_a_few_steps(mnist, tmp_path):
    """All three in one launch (one TensorFlow import per rank)."""
    in_one_launch(3, [[model, *extra, "--steps", "3", "--eval-every", "1", "--data-dir", mnist,
                       "--results-dir", tmp_path / f"{model}-{mode}", "--quiet",
                       *(["--async"] if mode == "async" else [])]
                      for model, extra, mode in RUNS], tmp_path, timeout=600)
    for model, _, mode in RUNS:
        run = read_rows(tmp_path / f"{model}-{mode}" / "runs.csv")[-1]
        assert (run["model"], run["mode"], run["np"], run["status"]) == (model, mode, "3", "ok")
        assert int(run["steps"]) > 0 and float(run["test_loss"]) == float(run["test_loss"])
