"""The user's own data (--data: npz, image folders, CIFAR-10 batches), model specs
(FILE.py:FUNCTION, module:FUNCTION) and mpitrain.fit's arguments: readers and every
error, without MPI."""

import pickle
import sys

import numpy as np
import pytest

from conftest import learnable_images, mnist_dir, write_cifar, write_image_folder
from mpitrain import api, data, models
from mpitrain.config import Config, resolve
from mpitrain.errors import DataError, UsageError


# ---- npz ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mnist_npz(tmp_path_factory):
    """An npz built from the real MNIST files, as a user would make one."""
    path = tmp_path_factory.mktemp("npz") / "mnist.npz"
    np.savez(path, **data.read_mnist_dir(mnist_dir()))
    return path


def test_npz_from_mnist(mnist_npz):
    ds = data.read_user_data(str(mnist_npz))
    assert (ds.name, ds.input_shape, ds.num_classes, ds.train_size) == \
        ("npz", (28, 28, 1), 10, 20000)
    assert ds.x_train.dtype == np.float32 and ds.x_train.max() == 1.0
    assert ds.y_test.dtype == np.int32 and len(ds.y_test) == 10000


def test_npz_loads_only_the_splits_asked(mnist_npz):
    ds = data.read_user_data(str(mnist_npz), splits=("test",))
    assert ds.x_train is None and ds.x_test is not None and len(ds.y_train) == 20000


def test_npz_features_any_class_count_and_float_pixels(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "f.npz"
    np.savez(path, x_train=rng.random((50, 7)), y_train=rng.integers(0, 13, 50),
             x_test=rng.random((10, 7)), y_test=np.full(10, 3))
    ds = data.read_user_data(str(path))
    assert ds.input_shape == (7,) and ds.x_train.dtype == np.float32
    assert ds.num_classes == int(np.load(path)["y_train"].max()) + 1


@pytest.mark.parametrize("arrays,message", [
    (dict(x_train=np.zeros((4, 3)), y_train=np.zeros(4, int), x_test=np.zeros((2, 3))),
     "missing array 'y_test'"),
    (dict(x_train=np.zeros((4, 3)), y_train=np.zeros(3, int), x_test=np.zeros((2, 3)),
          y_test=np.zeros(2, int)), "4 train examples but 3 labels"),
    (dict(x_train=np.zeros((4, 3)), y_train=np.array([0, 1, -1, 0]), x_test=np.zeros((2, 3)),
          y_test=np.zeros(2, int)), "negative labels"),
    (dict(x_train=np.zeros((4, 3)), y_train=np.array([0.5, 1, 1, 0]),
          x_test=np.zeros((2, 3)), y_test=np.zeros(2, int)), "integer class labels"),
    (dict(x_train=np.zeros((4, 3)), y_train=np.array([0, 1, 1, 0]), x_test=np.zeros((2, 3)),
          y_test=np.array([0, 2])), r"classes \[2\] that the training set never shows"),
])
def test_npz_errors_name_the_file(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message) as error:
        data.read_user_data(str(path))
    assert str(path) in str(error.value)


def test_truncated_npz(tmp_path, mnist_npz):
    path = tmp_path / "cut.npz"
    path.write_bytes(mnist_npz.read_bytes()[:100000])
    with pytest.raises(DataError, match=f"{path}: cannot read .*corrupt or truncated"):
        data.read_user_data(str(path))


def test_missing_or_unknown_path(tmp_path):
    with pytest.raises(DataError, match="no such file or directory; give an .npz"):
        data.read_user_data(str(tmp_path / "nope.npz"))
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(DataError, match="not a dataset mpitrain reads"):
        data.read_user_data(str(tmp_path / "x.csv"))


# ---- CIFAR-10 ------------------------------------------------------------------------------
def test_cifar_batches(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    ds = data.read_user_data(str(tmp_path))  # the parent directory works too
    assert (ds.name, ds.input_shape, ds.num_classes, ds.train_size) == \
        ("cifar10", (32, 32, 3), 10, 500)
    assert ds.classes == [f"class{k}" for k in range(10)]
    x, y = learnable_images(100, 1)  # batch 1 round-trips to channel-last images
    np.testing.assert_array_equal(ds.x_train[:100], x.astype(np.float32) / 255)
    np.testing.assert_array_equal(ds.y_train[:100], y)


def test_cifar_corrupt_missing_and_hostile_batches(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(b"\x80\x04garbage")
    with pytest.raises(DataError, match="data_batch_3: not a CIFAR-10 batch"):
        data.read_user_data(str(tmp_path))
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3: missing"):
        data.read_user_data(str(tmp_path))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with open(tmp_path / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        data.read_user_data(str(tmp_path))


# ---- image folders ---------------------------------------------------------------------------
def test_image_folder_holds_out_a_fixed_stratified_test_set(tmp_path):
    write_image_folder(tmp_path / "imgs", n=200, classes=4)
    a = data.read_user_data(str(tmp_path / "imgs"))
    b = data.read_user_data(str(tmp_path / "imgs"))
    assert (a.name, a.input_shape, a.num_classes, a.classes) == \
        ("images", (20, 20, 1), 4, ["c0", "c1", "c2", "c3"])
    assert a.train_size + len(a.y_test) == 200 and 15 <= len(a.y_test) <= 25
    assert set(a.y_test) == {0, 1, 2, 3}  # every class in the test set
    np.testing.assert_array_equal(a.x_test, b.x_test)


def test_image_folder_with_train_and_test_and_resize(tmp_path):
    write_image_folder(tmp_path, n=100, classes=3, split=True, suffix=".jpg")
    ds = data.read_user_data(str(tmp_path), image_size=12)
    assert ds.input_shape == (12, 12, 1) and (ds.train_size, len(ds.y_test)) == (80, 20)


def test_image_folder_errors(tmp_path):
    write_image_folder(tmp_path, n=40, classes=2)
    from PIL import Image

    Image.new("L", (9, 9)).save(tmp_path / "c0" / "odd.png")
    with pytest.raises(DataError, match="odd.png: image is 9x9 but .* is 20x20; pass "
                                        "--image-size"):
        data.read_user_data(str(tmp_path))
    (tmp_path / "c0" / "odd.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="odd.png: not a readable image"):
        data.read_user_data(str(tmp_path), image_size=20)
    empty = tmp_path / "empty"
    (empty / "only").mkdir(parents=True)
    with pytest.raises(DataError, match="expected class sub-folders"):
        data.read_user_data(str(empty))


def test_data_and_dataset_conflict():
    with pytest.raises(UsageError, match="--data gives the dataset: drop --dataset mnist"):
        resolve(Config(data="x.npz", dataset="mnist"), models.get("lr").defaults, 3)
    cfg = resolve(Config(model="resnet", data="x.npz"), models.get("resnet").defaults, 3)
    assert cfg.dataset == "file"  # not resnet's synthetic default


# ---- model specs -----------------------------------------------------------------------------
MODEL_FILE = '''
import keras

def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes)])

def three(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(3)])

def number(input_shape, num_classes):
    return 42

def raises(input_shape, num_classes):
    raise ValueError("no good")

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_file_spec_builds_and_names(model_file):
    spec = models.get(f"{model_file}:build")
    model = spec.build((28, 28, 1), 10)
    assert model.output_shape == (None, 10)
    assert spec.defaults == models.USER_DEFAULTS
    assert models.run_name(f"{model_file}:build") == "my_model-build"


def test_relative_file_spec_becomes_absolute(model_file, monkeypatch):
    monkeypatch.chdir(model_file.parent)
    assert models.canonical("my_model.py:build") == f"{model_file}:build"
    assert models.canonical("lr") == "lr"


def test_module_spec(model_file, monkeypatch):
    monkeypatch.chdir(model_file.parent)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(model_file.parent))])
    assert models.get("my_model:build").build((4,), 2).output_shape == (None, 2)


@pytest.mark.parametrize("function,message", [
    ("missing", "has no function 'missing'"),
    ("NOT_A_FUNCTION", "NOT_A_FUNCTION .*not a function"),
])
def test_spec_lookup_errors(model_file, function, message):
    with pytest.raises(UsageError, match=f"model {model_file}:{function}: .*{message}"):
        models.get(f"{model_file}:{function}")


@pytest.mark.parametrize("function,message", [
    ("three", r"output .*\(None, 3\); expected \(None, 10\)"),
    ("number", "returned int, not a keras.Model"),
    ("raises", r"building it for input \(28, 28, 1\) and 10 classes failed "
               r"\(ValueError: no good\)"),
])
def test_spec_build_errors(model_file, function, message):
    spec = models.get(f"{model_file}:{function}")
    with pytest.raises(UsageError, match=message):
        spec.build((28, 28, 1), 10)


def test_spec_import_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        models.get(f"{tmp_path}/absent.py:build")
    (tmp_path / "syntax.py").write_text("def build(:\n")
    with pytest.raises(UsageError, match=r"syntax error in .*syntax.py line 1"):
        models.get(f"{tmp_path}/syntax.py:build")
    (tmp_path / "imports.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(UsageError, match="importing it failed.*not_a_module_anywhere"):
        models.get(f"{tmp_path}/imports.py:build")
    with pytest.raises(UsageError, match="no module named 'no_such_pkg_xyz'"):
        models.get("no_such_pkg_xyz.models:build")


def test_unknown_name_mentions_the_spec_form():
    with pytest.raises(UsageError, match="unknown model 'nope'.*FILE.py:FUNCTION"):
        models.get("nope")


def test_resnet_is_resnet20():
    model = models.get("resnet").build((32, 32, 3), 10)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert trainable == 272474 and model.non_trainable_weights  # BatchNorm statistics


# ---- mpitrain.fit's arguments ------------------------------------------------------------------
def test_fit_arguments():
    x, y = np.zeros((4, 3)), np.zeros(4, int)
    with pytest.raises(UsageError, match="unknown option.*epoch_count"):
        api._config("lr", (x, y), (x, y), "sync", None, {"epoch_count": 3})
    with pytest.raises(UsageError, match="mode must be one of sync, async"):
        api._config("lr", (x, y), (x, y), "fast", None, {})
    with pytest.raises(UsageError, match="train=.*or data=PATH"):
        api._config("lr", (x, y), None, "sync", None, {})

    def build(input_shape, num_classes):
        return None
    cfg, explicit = api._config(build, (x, y), (x, y), "async", None, {"epochs": 2})
    assert cfg.async_mode and cfg.epochs == 2 and cfg.data == data.IN_MEMORY
    assert cfg.model.endswith(":test_fit_arguments.<locals>.build")
    assert {"epochs", "async_mode", "data"} <= explicit
    ds = data.read_user_data(cfg.data)
    assert (ds.name, ds.input_shape, ds.num_classes) == ("arrays", (3,), 1)
