"""The user's own data, ``--data PATH`` or the arrays given to ``mpitrain.fit``.

``PATH`` is an ``.npz`` with ``x_train, y_train, x_test, y_test`` (examples shaped
(H, W), which get a channel axis, (H, W, C) or (D,); integer labels 0..K-1); a
directory of class sub-folders of PNG/JPEG images (with ``train/`` and ``test/``
inside, each holding the class folders, or else a fixed stratified 10% of each class,
at least one image of every class with two or more, held out as the test set, the same
in every run whatever ``--seed``), decoded with Pillow and resized to ``--image-size``
(all images must otherwise share one size; RGB if any image has colour, else
grayscale); or CIFAR-10's python batches (``data_batch_1..5`` and ``test_batch``,
optional ``batches.meta``, or their parent ``cifar-10-batches-py/``). The input shape
is inferred; the number of classes K is the largest label + 1 over both splits (an npz;
so a label never used still counts as a class), the number of class folders (images)
or of ``batches.meta``'s names (CIFAR-10, else 10). Class index = position of the
folder name in sorted order. Every check runs on every rank alike (an npz's array
shapes are read from their headers, image sizes from every file's header), so the
ranks fail together. Every rank holds its splits in memory, except a shard set's
training split: data larger than memory is packed into one first.
"""

from __future__ import annotations

import pickle
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..errors import DataError, UsageError
from ..userfiles import not_regular, open_regular, stat_mode
from .memory import MemoryBudget
from .imagefolders import decode_images, image_mode, list_images
from .shards import SPLITS, USER_FORMATS, Dataset
from .shardset import glob_set, is_shard_set, shard_dataset


CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
#: the most classes a dataset may have: a label above it is taken for a mistake (an id,
#: not a class index) rather than a model with that many outputs
MAX_CLASSES = 100_000
#: what a run's config records as its --data when ``mpitrain.fit`` was given arrays
GIVEN_ARRAYS = "<arrays given to mpitrain.fit>"


def given_arrays(train, test) -> Dict[str, np.ndarray]:
    """``mpitrain.fit``'s ``train=(x, y)`` and ``test=(x, y)`` as numpy arrays by name
    (x_train, y_train, x_test, y_test); UsageError for anything numpy cannot take."""
    try:
        (x_train, y_train), (x_test, y_test) = train, test
    except (TypeError, ValueError):
        raise UsageError("train= and test= take (x, y) pairs of arrays") from None
    given = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    arrays = {}
    for key, value in given.items():
        try:  # the user's objects: any error (a ragged list, an __array__ that raises)
            arrays[key] = np.asarray(value)
        except Exception as e:  # noqa: BLE001
            lines = str(e).strip().splitlines()
            raise UsageError(f"fit(): {key} cannot be made an array ({type(e).__name__}: "
                             f"{lines[0] if lines else ''}); give numpy arrays") from None
    return arrays


def read_user(path: str, splits, image_size: Optional[int], budget: MemoryBudget,
              arrays: Optional[Dict[str, np.ndarray]] = None,
              eval_examples: int = 0, stream: bool = False) -> Dataset:
    """The user's dataset (see the module docstring) with the ``splits`` this rank
    needs, labels of both: ``arrays`` (:func:`given_arrays`) if given, else the data
    at ``path``; a shard set's training split is not read but streamed (see
    :func:`.shardset.shard_dataset`, which reads only the ``eval_examples`` sample of
    its test split), and with ``stream`` an image folder's
    (:func:`.imagestream.streamed_folder`). DataError naming the file for anything
    missing, corrupt or inconsistent, or too large for ``budget``."""
    if arrays is not None:
        keys = [f"x_{split}" for split in splits] + ["y_train", "y_test"]
        return _user_dataset("arrays", GIVEN_ARRAYS, {k: arrays[k] for k in keys})
    if path == GIVEN_ARRAYS:
        raise DataError(f"--data {path}: the run trained on arrays its script handed to "
                        "mpitrain.fit, which only that script has: resume it from the script "
                        "(mpitrain.fit(..., resume=RUN_DIR))")
    picked = glob_set(path)
    if picked:  # (a glob of a shard set's training shards)
        return _ignoring_image_size(shard_dataset(picked[0], splits, eval_examples, budget,
                                                  picked[1]), image_size)
    where = Path(path).expanduser().absolute()
    mode = stat_mode(where)
    try:
        if stat.S_ISREG(mode) and where.suffix == ".npz" and not stream:
            return _ignoring_image_size(_user_npz(where, splits, budget), image_size)
        if stat.S_ISDIR(mode) and is_shard_set(where):
            return _ignoring_image_size(shard_dataset(where, splits, eval_examples, budget),
                                        image_size)
        if stat.S_ISDIR(mode):
            cifar = _cifar_dir(where)
            if cifar is not None and not stream:
                return _ignoring_image_size(_user_cifar(cifar, splits), image_size)
            if stream and cifar is None:
                from .imagestream import streamed_folder

                return streamed_folder(where, splits, image_size, eval_examples, budget)
            if not stream:
                return _user_images(where, splits, image_size, budget)
        if stream and mode:
            raise UsageError(f"--stream: {where} is not an image folder; an npz or CIFAR-10 "
                             "is read whole: pack it into a shard set (mpitrain data pack), "
                             "which --data streams without --stream", everywhere=False)
    except MemoryError as e:
        raise DataError(f"--data {where}: does not fit in this rank's memory ({e}); data "
                        "larger than memory is not supported: train on a subset") from None
    if not mode:
        raise DataError(f"--data {where}: no such file or directory; give {USER_FORMATS}")
    if not stat.S_ISREG(mode):
        raise DataError(f"--data {not_regular(where, mode)}")
    raise DataError(f"--data {where}: not a dataset mpitrain reads; give {USER_FORMATS}")


def _ignoring_image_size(ds: Dataset, image_size: Optional[int]) -> Dataset:
    if image_size:
        ds.note = (f"--image-size {image_size} is ignored: only image folders are resized "
                   f"({ds.name} examples keep their shape {ds.input_shape})")
    return ds


def _user_dataset(kind: str, source: Union[str, Path], arrays: Dict[str, np.ndarray],
                  classes: Optional[List[str]] = None) -> Dataset:
    """A Dataset from the user's arrays: labels checked (integers 0..K-1, K from 2 to
    MAX_CLASSES, checked before they become int32), examples with a channel axis
    (pixels become float32 once loaded)."""
    for split in SPLITS:
        y = arrays["y_" + split]
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or
                               (np.issubdtype(y.dtype, np.floating) and
                                np.isfinite(y).all() and np.array_equal(y, np.round(y)))):
            raise DataError(f"{source}: y_{split} must be integer class labels, one per "
                            f"example (got {y.dtype} of shape {y.shape}); for one-hot "
                            "labels save y.argmax(axis=1)")
        if len(y) and y.min() < 0:
            raise DataError(f"{source}: y_{split} has negative labels; classes are 0..K-1")
        if len(y) and y.max() >= MAX_CLASSES:
            distinct = len(np.unique(y))
            raise DataError(f"{source}: y_{split} has labels up to {int(y.max()):,} but "
                            f"only {distinct:,} distinct labels; classes are 0..K-1, K at most "
                            f"{MAX_CLASSES:,}: relabel them 0..{distinct - 1} "
                            "(np.unique(y, return_inverse=True)[1])")
        if "x_" + split in arrays and len(arrays["x_" + split]) != len(y):
            raise DataError(f"{source}: {len(arrays['x_' + split])} {split} examples but "
                            f"{len(y)} labels")
        arrays["y_" + split] = y.astype(np.int32)
    if not len(arrays["y_train"]) or not len(arrays["y_test"]):
        raise DataError(f"{source}: the training and the test set must not be empty")
    seen = np.unique(arrays["y_train"])
    if len(seen) < 2:
        raise DataError(f"{source}: every training label is {int(seen[0])}: one class is "
                        "nothing to classify (every prediction would be right); give "
                        "examples of two classes or more")
    num_classes = len(classes) if classes else \
        int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    missing = set(np.unique(arrays["y_test"]).tolist()) - \
        set(np.unique(arrays["y_train"]).tolist())
    if missing:
        raise DataError(f"{source}: the test set has classes {sorted(missing)} that the "
                        "training set never shows")
    top = int(max(arrays["y_train"].max(), arrays["y_test"].max()))
    if classes and top >= len(classes):
        raise DataError(f"{source}: labels go up to {top} but only {len(classes)} classes "
                        f"are named ({', '.join(classes)}); fix the labels or the names")
    for key in [k for k in arrays if k.startswith("x_")]:
        x = arrays[key]
        if x.ndim < 2:
            raise DataError(f"{source}: {key} must hold one array per example (got shape "
                            f"{x.shape})")
        if 0 in x.shape[1:]:
            raise DataError(no_features(source, key, x.shape))
        if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
                or x.dtype == np.bool_):
            raise DataError(f"{source}: {key} holds {x.dtype}, not numbers; give pixels "
                            "(uint8 0..255, or floats) or numeric features")
        if np.issubdtype(x.dtype, np.floating) and not _finite_as_float32(x):
            raise DataError(f"{source}: {key} contains NaN or infinite values; remove or "
                            "replace them before training")
        arrays[key] = x[..., None] if x.ndim == 3 else x
    any_x = next(v for k, v in arrays.items() if k.startswith("x_"))
    named: Dict[str, Any] = arrays  # x_train, y_train, ... by name
    return Dataset(kind, str(source), num_classes, tuple(any_x.shape[1:]),
                   len(arrays["y_train"]), classes=classes, **named)


def _finite_as_float32(x: np.ndarray) -> bool:
    """Whether float examples stay finite as float32 (checked before the conversion, which
    only a worker's shard goes through: wider floats may overflow in it)."""
    if not np.isfinite(x).all():
        return False
    top = np.finfo(np.float32).max
    return x.dtype.itemsize <= 4 or not x.size or (x.max() <= top and x.min() >= -top)


def no_features(source, key: str, shape: Tuple[int, ...]) -> str:
    """The error of examples with no values (a zero in their shape): no kernel takes them,
    and oneDNN aborts the process on them instead of raising."""
    return (f"{source}: {key} is shaped {tuple(shape)}: its examples hold no values; "
            "each needs at least one feature or pixel")


def _npz_headers(npz) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """(shape, dtype) of an open NpzFile's arrays from their .npy headers (no data
    read)."""
    headers = {}
    for name in npz.zip.namelist():
        if not name.endswith(".npy"):
            continue  # np.load would not offer it as an array either
        with npz.zip.open(name) as member:
            version = np.lib.format.read_magic(member)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, _, dtype = header(member)
            headers[name[:-4]] = (tuple(shape), dtype)
    return headers


def _check_npz_shapes(path: Path, shapes: Dict[str, Tuple[int, ...]]) -> None:
    """What every rank can check of all four arrays, whichever splits it loads."""
    missing = [key for key in ("x_train", "y_train", "x_test", "y_test") if key not in shapes]
    if missing:
        raise DataError(f"{path}: missing array {', '.join(map(repr, missing))}; an "
                        "npz for --data holds x_train, y_train, x_test and y_test")
    for split in SPLITS:
        x, y = shapes["x_" + split], shapes["y_" + split]
        if len(x) < 2:
            raise DataError(f"{path}: x_{split} must hold one array per example, shaped "
                            f"(N, H, W), (N, H, W, C) or (N, D) (got shape {x})")
        if len(y) and y[0] != x[0]:
            raise DataError(f"{path}: {x[0]} {split} examples but {y[0]} labels")
        if 0 in x[1:]:
            raise DataError(no_features(path, f"x_{split}", x))
    if shapes["x_train"][1:] != shapes["x_test"][1:]:
        raise DataError(f"{path}: training examples are shaped {shapes['x_train'][1:]} but "
                        f"test examples {shapes['x_test'][1:]}; both splits must share one "
                        "shape")


def _user_npz(path: Path, splits, budget: MemoryBudget) -> Dataset:
    keys = [f"x_{split}" for split in splits] + ["y_train", "y_test"]
    try:
        with open_regular(path, DataError) as file, np.load(file, allow_pickle=False) as f:
            # every rank checks all four arrays' headers, so all ranks fail alike
            headers = _npz_headers(f)
            pickled = [name for name, (_, dtype) in headers.items() if dtype.hasobject]
            if pickled:
                raise DataError(f"{path}: {', '.join(pickled)} holds Python objects (a "
                                "pickled object array), which mpitrain does not unpickle; "
                                "save numeric arrays (np.asarray(x, np.float32))")
            _check_npz_shapes(path, {name: shape for name, (shape, _) in headers.items()})
            budget.check(sum(budget.array(*headers[key], key) for key in keys),
                         f"--data {path}: the arrays this rank reads", "data larger than memory "
                         "is not supported: train on a subset, or on more hosts")
            arrays = {key: np.asarray(f[key]) for key in keys}
    except DataError:
        raise
    except MemoryError:
        raise
    except Exception as e:  # zipfile.BadZipFile, ValueError, OSError, EOFError...
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is "
                        "corrupt or truncated, replace it") from None
    return _user_dataset("npz", path, arrays)


def _cifar_dir(path: Path) -> Optional[Path]:
    for candidate in (path, path / "cifar-10-batches-py"):
        if (candidate / "test_batch").exists() or (candidate / "data_batch_1").exists():
            return candidate
    return None


def _latin1(text, encoding="latin1"):
    """``_codecs.encode`` as Python 3 pickles bytes at protocol 2, latin-1 only."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refusing to encode with {encoding!r}")
    return text.encode("latin1")


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles CIFAR's batches (dicts of bytes, lists and numpy arrays, as Python 2
    wrote them or as Python 3 rewrites them at any protocol) and nothing else: a
    pickle that names any other class is refused, not executed."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype")} | {
        (f"numpy.{core}.{module}", name) for core in ("core", "_core")
        for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                             ("numeric", "_frombuffer"))}

    def find_class(self, module, name):
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _cifar_batch(path: Path, with_images: bool):
    if not path.exists():
        raise DataError(f"{path}: missing; CIFAR-10's python layout has data_batch_1..5 and "
                        "test_batch")
    try:
        with open_regular(path, DataError) as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        labels = np.asarray(batch[b"labels"], np.int64)
        images = np.asarray(batch[b"data"], np.uint8) if with_images else None
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated, not a pickle, wrong contents
        raise DataError(f"{path}: not a CIFAR-10 batch ({type(e).__name__}: {e}); the file "
                        "is corrupt or truncated, replace it") from None
    if images is not None:
        if images.ndim != 2 or images.shape != (len(labels), 3072):
            raise DataError(f"{path}: data has shape {images.shape}, expected "
                            f"({len(labels)}, 3072): 32x32x3 images, one row each")
        images = images.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels


def _user_cifar(directory: Path, splits) -> Dataset:
    arrays = {}
    for split, names in (("train", CIFAR_BATCHES), ("test", ("test_batch",))):
        parts = [_cifar_batch(directory / name, split in splits) for name in names]
        arrays["y_" + split] = np.concatenate([labels for _, labels in parts])
        if split in splits:
            arrays["x_" + split] = np.concatenate([images for images, _ in parts])
    classes = None
    meta = directory / "batches.meta"
    if meta.exists():
        try:
            with open_regular(meta, DataError) as f:
                names = _CifarUnpickler(f, encoding="bytes").load()[b"label_names"]
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{meta}: unreadable ({type(e).__name__}: {e}); replace or "
                            "remove it") from None
    return _user_dataset("cifar10", directory, arrays, classes)


def _user_images(directory: Path, splits, image_size: Optional[int],
                 budget: MemoryBudget) -> Dataset:
    """A folder of class folders (or train/ and test/ each holding them)."""
    classes, files = list_images(directory)
    mode, (width, height) = image_mode([f for split in SPLITS for f, _ in files[split]],
                                       image_size)
    side = (image_size, image_size) if image_size else (height, width)
    channels = 3 if mode == "RGB" else 1
    # decoded pixels, stacked (a second copy), then floats: checked before any is decoded
    budget.check(sum(budget.array((len(files[split]), *side, channels), np.uint8, f"x_{split}")
                     + len(files[split]) * side[0] * side[1] * channels for split in splits),
                 f"--data {directory}: {' and '.join(f'{len(files[s]):,} {s}' for s in splits)}"
                 f" image(s) of {side[1]}x{side[0]}x{channels}",
                 "stream it (--stream), pass a smaller --image-size, or pack it into a shard "
                 "set (mpitrain data pack)" if image_size else "stream it (--stream), pass "
                 "--image-size PX to shrink them, or pack it into a shard set "
                 "(mpitrain data pack)")
    arrays = {"y_" + split: np.array([c for _, c in files[split]], np.int64)
              for split in SPLITS}
    for split in splits:
        arrays["x_" + split] = decode_images(files[split], mode, image_size)
    return _user_dataset("images", directory, arrays, classes)


