"""End-to-end: training on the user's own data (--data) under real mpirun, and the
one-line errors of bad data, bounded so that a hang fails the test."""

import json

import numpy as np
import pytest

from conftest import in_one_launch, mpirun, read_rows
from unit.test_user_data import write_cifar, write_images, write_mnist_npz


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("mpitrain: error")]


def last_run(results):
    row = read_rows(results / "runs.csv")[-1]
    meta = json.loads((results / row["run"] / "config.json").read_text())
    return row, meta


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three kinds of the user's data, trained in one launch at -np 3 (one TensorFlow
    import per rank): {kind: (results dir, data source)}.

    * npz: 6,000 MNIST digits, one epoch of sync LR over 2 workers (30 steps);
    * cifar: lr on CIFAR-10-layout batches (32x32x3, 10 classes), given the parent
      directory;
    * images: lenet on a folder of JPEG class folders with train/ and test/ (24x24
      RGB, 5 classes)."""
    root = tmp_path_factory.mktemp("user-data")
    npz = write_mnist_npz(root / "mnist6k.npz", n_train=6000, n_test=2000)
    cifar = write_cifar(root / "cifar" / "cifar-10-batches-py", per_batch=200, n_test=300)
    images = write_images(root / "imgs", n=400, classes=5, channels=3, split=True,
                          suffix=".jpg")
    runs = {"npz": (npz, ["lr", "--data", npz, "--epochs", "1"]),
            "cifar": (cifar, ["lr", "--data", root / "cifar", "--steps", "30"]),
            "images": (images, ["lenet", "--data", images, "--epochs", "8", "--batch-size",
                                "32"])}
    in_one_launch(3, [[*args, "--results-dir", root / kind, "--quiet"]
                      for kind, (_, args) in runs.items()], root)
    return {kind: (root / kind, source) for kind, (source, _) in runs.items()}


@pytest.mark.slow
def test_lr_sync_on_an_npz_made_from_mnist(trained):
    results, path = trained["npz"]
    row, meta = last_run(results)
    assert (row["dataset"], row["input_shape"], row["num_classes"], row["steps"]) == \
        ("npz", "28x28x1", "10", "30")
    assert float(row["test_accuracy"]) > 0.6, row  # chance is 0.1; measured 0.82
    assert meta["dataset"]["source"] == str(path)
    assert (meta["dataset"]["input_shape"], meta["dataset"]["num_classes"],
            meta["dataset"]["train_size"]) == ([28, 28, 1], 10, 6000)
    assert meta["config"]["data"] == str(path) and meta["config"]["dataset"] == "file"


@pytest.mark.slow
@pytest.mark.parametrize("kind,expect", [
    ("cifar", ("cifar10", "32x32x3", "10", [f"name{k}" for k in range(10)], 0.1)),
    ("images", ("images", "24x24x3", "5", [f"c{k}" for k in range(5)], 0.2))])
def test_train_on_cifar_layout_and_image_folder(trained, kind, expect):
    """Both beat chance by 40 points."""
    results, source = trained[kind]
    row, meta = last_run(results)
    name, shape, classes, class_names, chance = expect
    assert (row["dataset"], row["input_shape"], row["num_classes"]) == (name, shape, classes)
    assert meta["dataset"]["classes"] == class_names
    assert meta["dataset"]["source"] == str(source)
    print(kind, "test accuracy", row["test_accuracy"], "steps", row["steps"])
    assert float(row["test_accuracy"]) >= chance + 0.4, row


def test_bad_files_give_one_line_and_exit_1(tmp_path):
    """A truncated npz (read by every rank) and an unreadable image in test/ (decoded by
    rank 0 only; the workers learn of it through the agreement): one line, code 1."""
    path = write_mnist_npz(tmp_path / "cut.npz", n_train=600, n_test=100)
    path.write_bytes(path.read_bytes()[:-3000])
    folder = write_images(tmp_path / "imgs", n=60, classes=3, split=True)
    (folder / "test" / "c1" / "0005.png").write_bytes(b"\x89PNG\r\n\x1a\ntruncated")
    for bad, named in ((path, "cut.npz: cannot read"),
                       (folder, "0005.png: not a readable image"),
                       (tmp_path / "missing.npz", "missing.npz: no such file or directory; "
                                                  "give an .npz")):
        result = mpirun(3, "lr", "--data", bad, "--results-dir", tmp_path / "res",
                        timeout=120)
        lines = error_lines(result)
        assert result.returncode == 1, result.stderr[-2000:]
        assert len(lines) == 1 and named in lines[0], result.stderr[-2000:]
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("model,extra,named", [
    ("lr", ["--dataset", "mnist"], "--data gives the dataset: drop --dataset mnist"),
    pytest.param("lenet", ["--steps", "1"], "lenet needs images of at least 12x12 (H, W, C), "
                 "but the data's examples have shape (784,)", marks=pytest.mark.slow),
])
def test_usage_errors_exit_2(tmp_path, model, extra, named):
    """A conflicting --dataset (found before MPI work), and LeNet on feature vectors
    (found when the model is built, after TensorFlow loads: ~25 s)."""
    vectors = write_mnist_npz(tmp_path / "flat.npz", n_train=600, n_test=100, flat=True)
    result = mpirun(3, model, "--data", vectors, *extra, "--results-dir", tmp_path / "res",
                    timeout=180)
    lines = error_lines(result)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and named in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
