"""--data PATH: every format on real files, what each rank sees when it loads only
its own splits (the errors must be the same on every rank), and every bad file.

The generators here (``write_*``) are also used by tests/e2e/test_user_data.py.
Their images are learnable: class k is a bright horizontal band at rows 3k..3k+2
(and, in colour, in channel k % 3) on dim noise.
"""

import io
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import mnist_dir
from mpitrain import data
from mpitrain.data import sources
from mpitrain.data.decoding import GIVEN_ARRAYS, given_arrays, read_user
from mpitrain.data.memory import MemoryBudget
from mpitrain.data.shards import SPLITS
from mpitrain.errors import DataError
from unit.test_data import OneRank

WORKER, SERVER = ("train",), ("test",)


# ---- generators ----------------------------------------------------------------------------
def banded(n: int, seed: int, size: int = 32, channels: int = 3, classes: int = 10):
    """uint8 images (n, size, size, channels) and labels: class k = a band at rows 3k.."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes  # balanced
    rng.shuffle(y)
    x = rng.integers(0, 80, (n, size, size, channels)).astype(np.uint8)
    for i, k in enumerate(y):
        x[i, 3 * k:3 * k + 3, :, k % channels] = 255
    return x, y


def write_mnist_npz(path: Path, n_train: int = 6000, n_test: int = 2000, flat=False) -> Path:
    """An npz made from the real MNIST (the first n examples of each split)."""
    arrays = sources.read_mnist_dir(mnist_dir())
    out = {"x_train": arrays["x_train"][:n_train], "y_train": arrays["y_train"][:n_train],
           "x_test": arrays["x_test"][:n_test], "y_test": arrays["y_test"][:n_test]}
    if flat:
        out["x_train"] = out["x_train"].reshape(n_train, -1)
        out["x_test"] = out["x_test"].reshape(n_test, -1)
    np.savez(path, **out)
    return path


def write_cifar(directory: Path, per_batch: int = 200, n_test: int = 300, meta=True,
                protocol: int = 2) -> Path:
    """CIFAR-10's python layout: pickled dicts with b'data' (N, 3072) channel-first rows."""
    directory.mkdir(parents=True, exist_ok=True)
    batches = [(f"data_batch_{b}", banded(per_batch, b)) for b in range(1, 6)]
    for name, (x, y) in batches + [("test_batch", banded(n_test, 99))]:
        rows = x.transpose(0, 3, 1, 2).reshape(len(x), 3072)
        with open(directory / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": [int(v) for v in y],
                         b"data": rows, b"filenames": [b"x.png"] * len(y)}, f,
                        protocol=protocol)
    if meta:
        with open(directory / "batches.meta", "wb") as f:
            pickle.dump({b"label_names": [f"name{k}".encode() for k in range(10)],
                         b"num_vis": 3072}, f)
    return directory


def write_images(directory: Path, n: int = 200, size: int = 24, classes: int = 4,
                 channels: int = 1, split: bool = False, suffix: str = ".png",
                 seed: int = 3) -> Path:
    """Class sub-folders ``c0..`` of images (under train/ and test/ when ``split``)."""
    from PIL import Image

    x, y = banded(n, seed, size, channels, classes)
    for i, (image, label) in enumerate(zip(x, y)):
        part = ("test" if i % 5 == 0 else "train") if split else ""
        folder = directory / part / f"c{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = image[..., 0] if channels == 1 else image
        Image.fromarray(pixels, "L" if channels == 1 else "RGB").save(
            folder / f"{i:04d}{suffix}", quality=95)
    return directory


def npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def both_ranks_raise(path, match, **kw):
    """A worker (training split) and the server (test split) fail with the same error."""
    messages = []
    for splits in (WORKER, SERVER):
        with pytest.raises(DataError, match=match) as error:
            data.read_user_data(str(path), splits, **kw)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    return messages[0]


# ---- npz -------------------------------------------------------------------------------------
def test_npz_from_real_mnist_images_and_vectors(tmp_path):
    ds = data.read_user_data(str(write_mnist_npz(tmp_path / "m.npz")))
    assert (ds.name, ds.input_shape, ds.num_classes, ds.train_size) == \
        ("npz", (28, 28, 1), 10, 6000)
    assert ds.source == str((tmp_path / "m.npz").absolute())
    assert ds.x_train.dtype == np.float32 and 0 <= ds.x_train.min() and ds.x_train.max() == 1
    raw = sources.read_mnist_dir(mnist_dir())["x_train"][:6000]
    np.testing.assert_allclose(ds.x_train[..., 0], raw / 255.0, atol=1e-6)
    flat = data.read_user_data(str(write_mnist_npz(tmp_path / "f.npz", flat=True)))
    assert flat.input_shape == (784,) and flat.x_test.shape == (2000, 784)


def test_npz_channels_kept_floats_kept_classes_are_max_label_plus_one(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 5, 6, 2)) * 10  # floats outside [0, 1] stay as they are
    y = np.array([0, 2, 5] * 10)  # labels 1, 3, 4 never occur: still 6 classes
    ds = data.read_user_data(str(npz(tmp_path / "a.npz", x_train=x, y_train=y,
                                     x_test=x[:6], y_test=y[:6])))
    assert ds.input_shape == (5, 6, 2) and ds.num_classes == 6
    np.testing.assert_array_equal(ds.x_train, x.astype(np.float32))
    assert ds.y_train.dtype == np.int32 and ds.classes is None


def test_each_rank_loads_only_its_split(tmp_path):
    path = write_mnist_npz(tmp_path / "m.npz", n_train=600, n_test=200)
    worker = data.read_user_data(str(path), WORKER)
    server = data.read_user_data(str(path), SERVER)
    assert worker.x_test is None and worker.x_train.shape == (600, 28, 28, 1)
    assert server.x_train is None and server.x_test.shape == (200, 28, 28, 1)
    # what the ranks agree on in data.load is the same on both
    assert (worker.name, worker.train_size, worker.num_classes, worker.input_shape) == \
        (server.name, server.train_size, server.num_classes, server.input_shape)


@pytest.mark.parametrize("arrays,message", [
    (dict(x_train=np.zeros((8, 4, 4)), y_train=np.zeros(8, int), x_test=np.zeros((2, 5, 5)),
          y_test=np.zeros(2, int)), r"training examples are shaped \(4, 4\) but test "
                                    r"examples \(5, 5\)"),
    (dict(x_train=np.zeros((8, 3)), y_train=np.zeros(8, int), x_test=np.zeros((2, 3)),
          y_test=np.zeros(3, int)), "2 test examples but 3 labels"),
    (dict(x_train=np.zeros((8, 3)), y_train=np.zeros(8, int), y_test=np.zeros(2, int)),
     "missing array 'x_test'"),
    (dict(x_train=np.zeros(8), y_train=np.zeros(8, int), x_test=np.zeros(2),
          y_test=np.zeros(2, int)), "x_train must hold one array per example"),
    # no features: oneDNN would abort every worker (SIGABRT) on them
    (dict(x_train=np.zeros((8, 0)), y_train=np.zeros(8, int), x_test=np.zeros((2, 0)),
          y_test=np.zeros(2, int)), r"x_train is shaped \(8, 0\): its examples hold no "
                                    r"values; each needs at least one feature or pixel"),
])
def test_npz_shape_errors_are_the_same_on_every_rank(tmp_path, arrays, message):
    path = npz(tmp_path / "bad.npz", **arrays)
    assert str(path) in both_ranks_raise(path, message)


@pytest.mark.parametrize("change,message", [
    (dict(x_train=np.array([["a"] * 3] * 8)), "x_train holds <U1, not numbers"),
    (dict(x_train=np.full((8, 3), np.nan)), "x_train contains NaN or infinite values"),
    # finite as float64, infinite as the float32 that training uses
    (dict(x_test=np.full((2, 3), -1e39)), "x_test contains NaN or infinite values"),
    (dict(y_train=np.array([0, 1] * 3 + [-1, 0])), "negative labels"),
    (dict(y_train=np.linspace(0, 1, 8)), "must be integer class labels"),
    (dict(y_train=np.eye(2)[[0, 1] * 4]), r"y_train must be integer class labels, one per "
                                          r"example \(got float64 of shape \(8, 2\)\); for "
                                          r"one-hot labels save y.argmax\(axis=1\)"),
    (dict(y_test=np.array([0, 7])), r"test set has classes \[7\] that the training set"),
])
def test_npz_content_errors(tmp_path, change, message):
    arrays = dict(x_train=np.zeros((8, 3)), y_train=np.array([0, 1] * 4),
                  x_test=np.zeros((2, 3)), y_test=np.array([0, 1]))
    path = npz(tmp_path / "bad.npz", **{**arrays, **change})
    with pytest.raises(DataError, match=message) as error:
        data.read_user_data(str(path))
    assert str(path) in str(error.value)


def test_examples_without_values_given_as_arrays_are_refused():
    with pytest.raises(DataError, match=r"x_test is shaped \(2, 4, 0\): its examples hold"):
        arrays = given_arrays((np.zeros((8, 4, 4)), np.array([0, 1] * 4)),
                              (np.zeros((2, 4, 0)), np.array([0, 1])))
        read_user(GIVEN_ARRAYS, SPLITS, None, MemoryBudget(2**30), arrays)


def test_an_npz_of_pickled_objects_is_named_as_such_not_as_corrupt(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, x_train=np.array([{"a": 1}] * 8, dtype=object), y_train=np.zeros(8, int),
             x_test=np.zeros((2, 3)), y_test=np.zeros(2, int))
    message = both_ranks_raise(path, "x_train holds Python objects .* mpitrain does not "
                                     "unpickle; save numeric arrays")
    assert "corrupt" not in message


def test_truncated_npz_names_the_file_on_every_rank(tmp_path):
    path = write_mnist_npz(tmp_path / "m.npz", n_train=600, n_test=200)
    path.write_bytes(path.read_bytes()[:-5000])
    assert str(path) in both_ranks_raise(path, "cannot read .*corrupt or truncated, replace it")


def test_larger_than_memory_is_one_clear_error(tmp_path):
    """Headers announcing ~10^15 bytes: refused from the headers, before anything is read."""
    from numpy.lib import format as npy

    def member(shape, body=b""):
        out = io.BytesIO()
        npy.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False,
                                         "shape": shape})
        return out.getvalue() + body

    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x_train.npy", member((10 ** 12, 784), b"\0" * 100))
        z.writestr("y_train.npy", member((10 ** 12,)))
        z.writestr("x_test.npy", member((2, 784), b"\0" * 1568))
        z.writestr("y_test.npy", member((2,), b"\0\0"))
    for splits in (WORKER, SERVER):  # the worker fails on x_train, the server on y_train
        with pytest.raises(DataError, match=f"--data {path}: the arrays this rank reads need "
                                            r"[0-9.]+ [GPT]iB of memory on each rank, but .* "
                                            r"available for its 1 rank\(s\); data larger than "
                                            "memory is not supported: train on a subset"):
            data.read_user_data(str(path), splits)


def test_image_size_is_ignored_for_npz_with_a_note(tmp_path):
    ds = data.read_user_data(str(write_mnist_npz(tmp_path / "m.npz", 100, 50)), image_size=32)
    assert ds.input_shape == (28, 28, 1) and "--image-size 32 is ignored" in ds.note


def test_missing_path_names_it_and_the_formats(tmp_path):
    with pytest.raises(DataError, match=r"--data .*nothere.npz: no such file or directory; "
                                        r"give an .npz .*class sub-folders.*CIFAR-10"):
        data.read_user_data(str(tmp_path / "nothere.npz"))


def test_load_is_the_collective_entry_point(tmp_path):
    ds = data.load("file", None, OneRank(), ("test",),
                   user_data=str(write_mnist_npz(tmp_path / "m.npz", 100, 50)))
    assert ds.name == "npz" and ds.x_train is None and len(ds.x_test) == 50


# ---- CIFAR-10 ----------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar_layout_and_its_parent(tmp_path, protocol):
    """Protocol 2 as CIFAR's own files (Python 3 writes bytes there via _codecs.encode);
    the highest as a user re-pickling batches would (numpy's _frombuffer)."""
    write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    for path in (tmp_path, tmp_path / "cifar-10-batches-py"):
        ds = data.read_user_data(str(path))
        assert (ds.name, ds.input_shape, ds.num_classes, ds.train_size, len(ds.y_test)) == \
            ("cifar10", (32, 32, 3), 10, 1000, 300)
        assert ds.classes == [f"name{k}" for k in range(10)]
        assert ds.source.endswith("cifar-10-batches-py")
    x, y = banded(200, 3)  # data_batch_3 is examples 400..599, channel-last again
    np.testing.assert_array_equal(ds.x_train[400:600], x / np.float32(255))
    np.testing.assert_array_equal(ds.y_train[400:600], y)
    server = data.read_user_data(str(tmp_path), SERVER)
    assert server.x_train is None and server.train_size == 1000


def test_cifar_without_meta_has_unnamed_classes(tmp_path):
    ds = data.read_user_data(str(write_cifar(tmp_path, 20, 20, meta=False)))
    assert ds.classes is None and ds.num_classes == 10


def test_cifar_bad_batches(tmp_path):
    write_cifar(tmp_path, 20, 20)
    good = (tmp_path / "data_batch_2").read_bytes()
    (tmp_path / "data_batch_2").write_bytes(good[:len(good) // 2])
    both_ranks_raise(tmp_path, "data_batch_2: not a CIFAR-10 batch .*corrupt or truncated")
    with open(tmp_path / "data_batch_2", "wb") as f:  # 16x16 rows instead of 32x32x3
        pickle.dump({b"data": np.zeros((20, 768), np.uint8), b"labels": [0] * 20}, f)
    with pytest.raises(DataError, match=r"data_batch_2: data has shape \(20, 768\), "
                                        r"expected \(20, 3072\)"):
        data.read_user_data(str(tmp_path), WORKER)
    (tmp_path / "data_batch_2").write_bytes(good)
    (tmp_path / "test_batch").unlink()
    both_ranks_raise(tmp_path, "test_batch: missing")


def test_cifar_labels_beyond_the_named_classes(tmp_path):
    write_cifar(tmp_path, 20, 20)
    with open(tmp_path / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"cat", b"dog"]}, f)
    both_ranks_raise(tmp_path, "labels go up to 9 but only 2 classes are named")


# ---- image folders -----------------------------------------------------------------------
def test_image_folder_stratified_fixed_holdout(tmp_path):
    write_images(tmp_path, n=203, classes=4)  # 51, 51, 51, 50 images per class
    ds = data.read_user_data(str(tmp_path))
    assert (ds.name, ds.input_shape, ds.num_classes, ds.classes) == \
        ("images", (24, 24, 1), 4, ["c0", "c1", "c2", "c3"])
    assert np.bincount(ds.y_test).tolist() == [5, 5, 5, 5]  # 10% of each class
    assert ds.train_size == 203 - 20
    again = data.read_user_data(str(tmp_path), SERVER)
    np.testing.assert_array_equal(ds.x_test, again.x_test)
    # the held-out images are not in the training set
    train = {a.tobytes() for a in ds.x_train}
    assert not any(a.tobytes() in train for a in ds.x_test)


def test_small_classes_hold_out_at_least_one(tmp_path):
    write_images(tmp_path, n=12, classes=4)  # 3 per class
    ds = data.read_user_data(str(tmp_path))
    assert np.bincount(ds.y_test).tolist() == [1, 1, 1, 1] and ds.train_size == 8


def test_image_folder_with_train_and_test_rgb_jpeg(tmp_path):
    write_images(tmp_path, n=100, classes=5, channels=3, split=True, suffix=".jpg")
    ds = data.read_user_data(str(tmp_path))
    assert (ds.input_shape, ds.num_classes, ds.train_size, len(ds.y_test)) == \
        ((24, 24, 3), 5, 80, 20)
    assert ds.classes == ["c0", "c1", "c2", "c3", "c4"]
    # the band survives JPEG: class k's rows 3k..3k+2 are the brightest in channel k % 3
    for image, label in zip(ds.x_test, ds.y_test):
        rows = image[:, :, label % 3].mean(axis=1)
        assert 3 * label <= int(rows.argmax()) <= 3 * label + 2


def test_mixed_modes_become_rgb_and_resize(tmp_path):
    from PIL import Image

    write_images(tmp_path, n=40, classes=2, size=24)
    Image.new("RGB", (50, 30), (255, 0, 0)).save(tmp_path / "c1" / "zz-colour.png")
    ds = data.read_user_data(str(tmp_path), image_size=16)
    assert ds.input_shape == (16, 16, 3)
    red = [x for x in np.concatenate([ds.x_train, ds.x_test]) if x[..., 0].min() == 1.0]
    assert len(red) == 1 and red[0][..., 1].max() == 0.0


def test_image_size_mismatch_across_splits_fails_on_every_rank(tmp_path):
    """A test image of another size: the workers (which decode only train/) must fail
    too, naming the same file, not train while the server fails."""
    from PIL import Image

    write_images(tmp_path, n=50, classes=2, split=True)
    Image.new("L", (30, 20)).save(tmp_path / "test" / "c1" / "odd.png")
    message = both_ranks_raise(tmp_path, r"odd.png: image is 30x20 but .* is 24x24; pass "
                                         r"--image-size PX")
    assert str(tmp_path / "test" / "c1" / "odd.png") in message
    assert data.read_user_data(str(tmp_path), image_size=24).input_shape == (24, 24, 1)


def test_image_folder_errors(tmp_path):
    write_images(tmp_path / "a", n=40, classes=2)
    bad = tmp_path / "a" / "c0" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    both_ranks_raise(tmp_path / "a", "broken.png: not a readable image")
    bad.unlink()
    (tmp_path / "a" / "c9").mkdir()
    both_ranks_raise(tmp_path / "a", r"c9: no training images \(PNG/JPEG\) for class 'c9'")

    write_images(tmp_path / "b", n=40, classes=2, split=True)
    (tmp_path / "b" / "test" / "extra").mkdir()
    both_ranks_raise(tmp_path / "b", r"classes \['extra'\] are not in .*train")

    (tmp_path / "c" / "one").mkdir(parents=True)
    both_ranks_raise(tmp_path / "c", "expected class sub-folders holding PNG/JPEG images")


# ---- models on the inferred shapes ---------------------------------------------------------
@pytest.mark.parametrize("model,shape", [("lr", (32, 32, 3)), ("lenet", (32, 32, 3)),
                                         ("lr", (784,)), ("lenet", (12, 12, 1))])
def test_builtin_models_take_the_inferred_shape(model, shape):
    from mpitrain import models

    built = models.get(model).build(shape, 7)
    assert tuple(built.output_shape) == (None, 7)


@pytest.mark.parametrize("model,shape", [("lenet", (784,)), ("lenet", (10, 10, 1)),
                                         ("resnet", (20,))])
def test_conv_models_on_vectors_are_a_usage_error(model, shape):
    from mpitrain import models
    from mpitrain.errors import UsageError

    with pytest.raises(UsageError, match=rf"{model} needs images .* shape "
                                         rf"{re.escape(str(shape))}.*use lr"):
        models.get(model).build(shape, 10)


# ---- configuration -----------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (dict(dataset="synthetic"), "--data gives the dataset: drop --dataset synthetic"),
    (dict(data_dir="/somewhere"), "--data-dir tells where MNIST is and --data gives your own "
                                  "data: drop one of them"),
])
def test_data_conflicts_are_usage_errors(extra, message):
    from mpitrain import models
    from mpitrain.config import Config, resolve
    from mpitrain.errors import UsageError

    with pytest.raises(UsageError, match=message):
        resolve(Config.of(data="my.npz", **extra), models.get("lenet").defaults, 4)
    cfg = resolve(Config.of(model="alexnet", data="my.npz", dataset="auto"),
                  models.get("alexnet").defaults, 4)
    assert cfg.data.dataset == "file"  # alexnet's synthetic default does not apply


def test_runs_csv_from_before_data_gains_the_columns(tmp_path):
    """A runs.csv written before input_shape/num_classes existed: the next row (a --data
    run, built by session.run_row) adds the columns; the old rows keep empty cells."""
    from mpitrain import models
    from mpitrain.results import run_dir as results
    from mpitrain.run import session
    from mpitrain.config import Config, resolve

    table = tmp_path / "runs.csv"
    table.write_text("run,model,mode,np,dataset,status,test_accuracy\n"
                     "old-run,lr,sync,3,mnist,ok,0.92\n")
    ds = data.read_user_data(str(write_mnist_npz(tmp_path / "m.npz", 100, 50)), SERVER)
    cfg = resolve(Config.of(data=str(tmp_path / "m.npz")), models.get("lr").defaults, 3)
    results.append_run_row(table, {"run": "new-run", **session.run_row(cfg, ds, None)})
    old, new = results.read_csv(table)
    assert (old["run"], old["test_accuracy"], old["input_shape"], old["num_classes"]) == \
        ("old-run", "0.92", "", "")
    assert (new["dataset"], new["input_shape"], new["num_classes"]) == ("npz", "28x28x1", "10")
