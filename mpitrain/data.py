"""Datasets and how they are split among workers.

MNIST is looked for in this order: ``--data-dir``, ``$MPITRAIN_DATA_DIR``, the
Keras cache (``~/.keras/datasets/mnist.npz``), then downloaded (Keras' URL, or
``$MPITRAIN_MNIST_URL`` for a mirror) with its SHA-256 checked. A data
directory may hold the four standard IDX files (gzipped or raw) or ``mnist.npz``.

``--dataset auto`` falls back to scikit-learn's bundled 8x8 digits, upscaled to
28x28, when none of these works (an offline machine), and says so;
``--dataset mnist`` fails instead. Every rank loads the splits it needs itself
(workers the training set, the server the test set); :func:`load` makes the
ranks agree on what was loaded, so a host without data fails the whole job
with one message rather than training on different data.

The user's own data comes with ``--data PATH`` (:func:`read_user_data`): an
``.npz`` with ``x_train, y_train, x_test, y_test`` (examples shaped (H, W),
which get a channel axis, (H, W, C) or (D,); integer labels 0..K-1); a
directory of class sub-folders of PNG/JPEG images (with ``train/`` and
``test/`` inside, each holding the class folders, or else a fixed stratified
10% of each class, at least one image of every class with two or more, held
out as the test set, the same in every run whatever ``--seed``), decoded with
Pillow and resized to ``--image-size`` (all images must otherwise share one
size; RGB if any image has colour, else grayscale); or CIFAR-10's python
batches (``data_batch_1..5`` and ``test_batch``, optional ``batches.meta``, or
their parent ``cifar-10-batches-py/``). The input shape is inferred; the number
of classes K is the largest label + 1 over both splits (an npz; so a label
never used still counts as a class), the number of class folders (images) or
of ``batches.meta``'s names (CIFAR-10, else 10). Class index = position of the
folder name in sorted order. Every check runs on every rank alike (an npz's
array shapes are read from their headers, image sizes from every file's
header), so the ranks fail together. Every rank holds its splits in memory:
data larger than memory is out of scope.

Images are float32 in [0, 1] shaped (N, H, W, C) (uint8 pixels are scaled;
float data is kept as it is); labels are int32.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import stat
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from .atomic import atomic_file
from .errors import DataError, UsageError
from .userfiles import not_regular, open_regular, stat_mode

KERAS_MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
KERAS_MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
KERAS_CACHE = Path("~/.keras/datasets/mnist.npz")

SPLITS = ("train", "test")
IDX_NAMES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
# IDX type codes (third byte of the magic number) -> numpy big-endian dtype
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

HOW_TO_GET_MNIST = (
    "supply MNIST with --data-dir DIR or $MPITRAIN_DATA_DIR (IDX files or mnist.npz), "
    f"or put mnist.npz in {KERAS_CACHE}, or allow the download from {KERAS_MNIST_URL}")


@dataclass
class Dataset:
    """The splits a rank loaded, with where they came from."""

    name: str  # mnist, digits or synthetic: recorded in the results
    source: str  # a path or URL, for the log and config.json
    num_classes: int
    input_shape: Tuple[int, ...]
    train_size: int
    x_train: Optional[np.ndarray] = None
    y_train: Optional[np.ndarray] = None
    x_test: Optional[np.ndarray] = None
    y_test: Optional[np.ndarray] = None
    note: str = ""  # a line the user must see (e.g. the offline fallback)
    classes: Optional[List[str]] = None  # class names, where the data names them


# ---------------------------------------------------------------------------------------
# File formats
# ---------------------------------------------------------------------------------------
def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped); raise :class:`DataError` naming it if bad.
    Reads no more than its header announces (and one byte, to tell a longer file)."""
    path = Path(path)
    try:
        with open_regular(path, DataError) as file, \
                (gzip.GzipFile(fileobj=file) if path.suffix == ".gz" else file) as f:
            raw = f.read(4)
            raw += f.read(4 * raw[3] if len(raw) == 4 else 0)
            raw += f.read(_idx_data_bytes(raw) + 1)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({e}); the file is corrupt or truncated, "
                        "replace it") from None
    return parse_idx(raw, str(path))


def _idx_data_bytes(header: bytes) -> int:
    """The data bytes an IDX header announces (0 for a header too bad to say)."""
    if len(header) < 4 or header[2] not in _IDX_DTYPES or len(header) < 4 + 4 * header[3]:
        return 0
    shape = np.frombuffer(header, ">i4", count=header[3], offset=4).astype(np.int64)
    return int(np.prod(shape)) * np.dtype(_IDX_DTYPES[header[2]]).itemsize if header[3] else 0


def parse_idx(raw: bytes, name: str) -> np.ndarray:
    """Decode IDX bytes: magic (0, 0, type, ndim), ndim big-endian int32 sizes, data."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{name}: not an IDX file (bad magic number); replace it")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(f"{name}: truncated IDX header; replace the file")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(f"{name}: IDX header announces {shape} ({expected} bytes of data) "
                        f"but the file holds {len(raw) - header}; the file is truncated or "
                        "corrupt, replace it")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape)


def _find_idx(directory: Path, stem: str) -> Optional[Path]:
    # LeCun's names, with '.' or '-' before idx, gzipped or raw
    for name in (stem, stem.replace("-idx", ".idx")):
        for suffix in (".gz", ""):
            candidate = directory / (name + suffix)
            if candidate.exists():  # not a regular file: read_idx says what it is
                return candidate
    return None


def _keys(splits) -> List[str]:
    # training labels always: they are small and give every rank the training-set size
    keys = [prefix + split for split in splits for prefix in ("x_", "y_")]
    return keys if "y_train" in keys else keys + ["y_train"]


def read_mnist_dir(directory: Union[str, Path], splits=SPLITS) -> Dict[str, np.ndarray]:
    """The MNIST arrays of ``splits`` from IDX files or ``mnist.npz`` in ``directory``."""
    directory = Path(directory)
    found = {key: _find_idx(directory, IDX_NAMES[key]) for key in _keys(splits)}
    if all(found.values()):
        arrays = {key: read_idx(path) for key, path in found.items()}
        origin = str(directory)
    elif (directory / "mnist.npz").exists():
        arrays = read_npz(directory / "mnist.npz", splits)
        origin = str(directory / "mnist.npz")
    else:
        missing = [IDX_NAMES[k] + "[.gz]" for k, v in found.items() if v is None]
        raise DataError(f"{directory}: no MNIST here (missing {', '.join(missing)} "
                        "and no mnist.npz)")
    check_mnist_arrays(arrays, origin)
    return arrays


def read_npz(path: Path, splits=SPLITS) -> Dict[str, np.ndarray]:
    """The arrays of ``splits`` from a Keras-style ``mnist.npz``."""
    try:
        with open_regular(path, DataError) as file, np.load(file, allow_pickle=False) as f:
            return {key: np.asarray(f[key]) for key in _keys(splits)}
    except DataError:
        raise
    except KeyError as e:
        raise DataError(f"{path}: missing array {e} (expected x_train, y_train, x_test, "
                        "y_test)") from None
    except Exception as e:  # zipfile.BadZipFile, ValueError, OSError, EOFError...
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is "
                        "corrupt or truncated, replace it") from None


def check_mnist_arrays(arrays: Dict[str, np.ndarray], origin: str) -> None:
    """Shapes and label ranges MNIST must have; DataError naming ``origin`` otherwise."""
    for split in SPLITS:
        if "x_" + split not in arrays:
            continue
        x, y = arrays["x_" + split], arrays["y_" + split]
        if x.ndim != 3 or x.shape[1:] != (28, 28):
            raise DataError(f"{origin}: {split} images have shape {x.shape}, "
                            "expected (N, 28, 28)")
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{origin}: {len(x)} {split} images but labels of shape {y.shape}")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise DataError(f"{origin}: {split} labels outside 0..9")


# ---------------------------------------------------------------------------------------
# Finding and downloading MNIST
# ---------------------------------------------------------------------------------------
def local_mnist(data_dir: Optional[str],
                splits=SPLITS) -> Tuple[Optional[Dict[str, np.ndarray]], str]:
    """MNIST from an explicit directory, $MPITRAIN_DATA_DIR or the Keras cache.

    Returns (arrays, origin), or (None, "") when no local copy exists. An
    explicitly named directory that does not exist or lacks MNIST is an error:
    the user asked for it.
    """
    for explicit, label in ((data_dir, "--data-dir"),
                            (os.environ.get("MPITRAIN_DATA_DIR"), "$MPITRAIN_DATA_DIR")):
        if explicit:
            directory = Path(explicit).expanduser()
            if not directory.is_dir():
                raise DataError(f"{label} {directory}: no such directory; point it at a "
                                "folder holding the MNIST IDX files or mnist.npz")
            return read_mnist_dir(directory, splits), str(directory)
    cache = KERAS_CACHE.expanduser()
    if cache.exists():
        arrays = read_npz(cache, splits)
        check_mnist_arrays(arrays, str(cache))
        return arrays, str(cache)
    return None, ""


def download(url: str, dest: Path, sha256: str, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to ``dest`` atomically, verifying its SHA-256; DataError if it fails."""
    dest = Path(dest).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        # several ranks of one host may download at once: a temporary file each
        with urllib.request.urlopen(url, timeout=timeout) as response, \
                atomic_file(dest, "wb", tmp_suffix=f".{os.getpid()}.part") as out:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
            if digest.hexdigest() != sha256:  # raising here keeps dest as it was
                raise DataError(f"download of {url}: SHA-256 {digest.hexdigest()} does not "
                                f"match the expected {sha256}; the mirror or the transfer "
                                "is corrupt")
    except OSError as e:  # URLError, timeouts and disk errors are all OSErrors
        raise DataError(f"cannot download {url} ({getattr(e, 'reason', e)})") from None
    return dest


def mnist_url() -> str:
    return os.environ.get("MPITRAIN_MNIST_URL", KERAS_MNIST_URL)


# ---------------------------------------------------------------------------------------
# Other datasets
# ---------------------------------------------------------------------------------------
def digits_upscaled(seed: int = 0) -> Dict[str, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (1797 images) upscaled to 28x28.

    Pixels are repeated 3x3 into 24x24 and padded by 2 on each side, the way
    MNIST centres digits in a 20x20 box inside 28x28. A fixed 80/20 split.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.kron(bunch.images, np.ones((3, 3))) / 16.0 * 255.0
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).astype(np.uint8)
    labels = bunch.target.astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return {"x_train": images[train], "y_train": labels[train],
            "x_test": images[test], "y_test": labels[test]}


class RepeatingImages:
    """``n`` images that cycle through a small pool of distinct ones (synthetic data).

    Throughput benchmarks feed random ImageNet-shaped input; storing a whole
    shard at 224x224x3 would take ~0.6 MB per image, so a pool of random images
    stands in for every example: example i is pool[(offset + i) % pool size].
    Indexing with an array gives a real batch; slicing gives a view (a shard).
    """

    def __init__(self, pool: np.ndarray, n: int, offset: int = 0):
        self.pool, self.n, self.offset = pool, n, offset

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.n,) + self.pool.shape[1:]

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.n)
            return self.pool[(self.offset + np.arange(start, stop)) % len(self.pool)]
        return self.pool[(self.offset + np.asarray(index)) % len(self.pool)]

    def shard(self, start: int, stop: int) -> "RepeatingImages":
        return RepeatingImages(self.pool, stop - start, self.offset + start)


def take_shard(array, start: int, stop: int):
    """A worker's own copy of its shard (a view for synthetic data, which has no copies)."""
    if isinstance(array, RepeatingImages):
        return array.shard(start, stop)
    return array[start:stop].copy()


def synthetic(n_train: int, n_test: int, image_size: int, channels: int, num_classes: int,
              seed: int, splits=("train", "test"), pool: int = 64) -> Dict[str, object]:
    """Random images with random labels, generated in memory without I/O.

    Every rank generates the same data from ``seed`` (a worker keeps its shard).
    """
    out: Dict[str, object] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        out["y_" + split] = rng.integers(0, num_classes, n, dtype=np.int32)
        if split in splits:
            images = rng.random((min(pool, n), image_size, image_size, channels),
                                dtype=np.float32)
            out["x_" + split] = RepeatingImages(images, n)
    return out


# ---------------------------------------------------------------------------------------
# The user's data: --data PATH
# ---------------------------------------------------------------------------------------
USER_FORMATS = ("an .npz with x_train, y_train, x_test, y_test; a directory of class "
                "sub-folders of PNG/JPEG images; or CIFAR-10's python batches "
                "(data_batch_1..5, test_batch)")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
#: an image folder without train/ and test/ holds out this share of each class as test
HOLDOUT = 0.1
#: the most classes a dataset may have: a label above it is taken for a mistake (an id,
#: not a class index) rather than a model with that many outputs
MAX_CLASSES = 100_000


#: ``mpitrain.fit``'s arrays, by the name its config records for them
_IN_MEMORY: Dict[str, Dict[str, np.ndarray]] = {}
IN_MEMORY = "<arrays given to mpitrain.fit>"


def provide_arrays(train, test) -> str:
    """Make ``(x, y)`` pairs readable as ``--data`` in this process; returns the name."""
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
    _IN_MEMORY[IN_MEMORY] = arrays
    return IN_MEMORY


@dataclass(frozen=True)
class MemoryBudget:
    """What one rank may hold: the memory its host has ``available``, shared by the
    ``ranks`` of the job there. Data is checked against it before it is read."""

    available: int
    ranks: int = 1
    host: str = "this host"
    #: the share of the training split this rank keeps as float32 (a worker's shard)
    train_share: float = 1.0

    @classmethod
    def of(cls, comm, shard: Optional[Tuple[int, int]] = None) -> "MemoryBudget":
        return cls(available_memory(), max(1, list(comm.hosts).count(comm.host)), comm.host,
                   1.0 / shard[0] if shard else 1.0)

    def check(self, needed: float, what: str, fix: str, error=DataError) -> None:
        """``error`` (not agreed on yet: see :func:`load`) if ``needed`` bytes per rank
        will not fit."""
        if needed > self.available / self.ranks:
            raise error(f"{what} need {_size(needed)} of memory on each rank, but "
                        f"{self.host} has {_size(self.available)} available for its "
                        f"{self.ranks} rank(s); {fix}", everywhere=False)

    def array(self, shape: Tuple[int, ...], dtype, key: str) -> float:
        """Bytes of the array ``key`` (x_train, y_test...) of ``shape`` and ``dtype``
        read whole, and for examples of the float32 copy of this rank's share of them
        (none for float32, used as it is)."""
        n = float(np.prod(shape, dtype=np.float64))
        share = self.train_share if key == "x_train" else 1.0
        floats = key.startswith("x_") and np.dtype(dtype) != np.float32
        return n * np.dtype(dtype).itemsize + (4 * n * share if floats else 0)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def available_memory() -> int:
    """Bytes this host can still give this process: the kernel's MemAvailable, or less
    where a control group limits it (a container, a SLURM job)."""
    import psutil

    free = psutil.virtual_memory().available
    for group in _cgroup_dirs():
        for limit, usage in (("memory.max", "memory.current"),
                             ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            try:
                free = min(free, int((group / limit).read_text()) -
                           int((group / usage).read_text()))
            except (OSError, ValueError):  # not this version's file, or "max": no limit
                continue
    return max(0, free)


def _cgroup_dirs() -> List[Path]:
    """This process's memory control group directories (v2 unified, v1 memory)."""
    found = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if controllers == "":
                found.append(Path("/sys/fs/cgroup") / where.lstrip("/"))
            elif "memory" in controllers.split(","):
                found.append(Path("/sys/fs/cgroup/memory") / where.lstrip("/"))
    except (OSError, ValueError):
        pass
    return found


def read_user_data(path: str, splits=SPLITS, image_size: Optional[int] = None,
                   budget: Optional[MemoryBudget] = None) -> Dataset:
    """The dataset at ``path`` (see the module docstring), with the ``splits`` this
    rank needs; labels of both splits always (they fix the number of classes).
    DataError naming the file for anything missing, corrupt or inconsistent, or too
    large for ``budget`` (default: this host's available memory)."""
    return _finish(_read_user_data(path, splits, image_size, budget), shard=None)


def _read_user_data(path: str, splits, image_size: Optional[int],
                    budget: Optional[MemoryBudget] = None) -> Dataset:
    budget = budget or MemoryBudget(available_memory())
    if path in _IN_MEMORY:
        given = _IN_MEMORY[path]
        keys = [f"x_{split}" for split in splits] + ["y_train", "y_test"]
        return _user_dataset("arrays", path, {k: given[k] for k in keys})
    where = Path(path).expanduser().absolute()
    mode = stat_mode(where)
    try:
        if stat.S_ISREG(mode) and where.suffix == ".npz":
            return _ignoring_image_size(_user_npz(where, splits, budget), image_size)
        if stat.S_ISDIR(mode):
            cifar = _cifar_dir(where)
            if cifar is not None:
                return _ignoring_image_size(_user_cifar(cifar, splits), image_size)
            return _user_images(where, splits, image_size, budget)
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


def _user_dataset(kind: str, source: Path, arrays: Dict[str, np.ndarray],
                  classes: Optional[List[str]] = None) -> Dataset:
    """A Dataset from the user's arrays: labels checked (integers 0..K-1, K from 2 to
    MAX_CLASSES, checked before they become int32), examples with a channel axis
    (pixels become float32 in :func:`_finish`)."""
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
        if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
                or x.dtype == np.bool_):
            raise DataError(f"{source}: {key} holds {x.dtype}, not numbers; give pixels "
                            "(uint8 0..255, or floats) or numeric features")
        if np.issubdtype(x.dtype, np.floating) and not _finite_as_float32(x):
            raise DataError(f"{source}: {key} contains NaN or infinite values; remove or "
                            "replace them before training")
        arrays[key] = x[..., None] if x.ndim == 3 else x
    any_x = next(v for k, v in arrays.items() if k.startswith("x_"))
    return Dataset(kind, str(source), num_classes, tuple(any_x.shape[1:]),
                   len(arrays["y_train"]), classes=classes, **arrays)


def _finite_as_float32(x: np.ndarray) -> bool:
    """Whether float examples stay finite as float32 (checked before the conversion, which
    only a worker's shard goes through: wider floats may overflow in it)."""
    if not np.isfinite(x).all():
        return False
    top = np.finfo(np.float32).max
    return x.dtype.itemsize <= 4 or not x.size or (x.max() <= top and x.min() >= -top)


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


def _class_folders(directory: Path) -> List[Path]:
    return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_in(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def _user_images(directory: Path, splits, image_size: Optional[int],
                 budget: MemoryBudget) -> Dataset:
    """A folder of class folders (or train/ and test/ each holding them)."""
    if (directory / "train").is_dir() and (directory / "test").is_dir():
        classes = [p.name for p in _class_folders(directory / "train")]
        test_classes = [p.name for p in _class_folders(directory / "test")]
        if set(test_classes) - set(classes):
            raise DataError(f"{directory / 'test'}: classes {sorted(set(test_classes) - set(classes))} "
                            f"are not in {directory / 'train'}")
        files = {split: [(f, classes.index(c.name)) for c in _class_folders(directory / split)
                         for f in _images_in(c)] for split in SPLITS}
    else:
        folders = _class_folders(directory)
        classes = [p.name for p in folders]
        files = {"train": [], "test": []}
        for index, folder in enumerate(folders):
            images = _images_in(folder)
            # a fixed split, whatever --seed: the test set is the same in every run
            order = np.random.default_rng(index).permutation(len(images))
            n_test = max(1, int(round(HOLDOUT * len(images)))) if len(images) > 1 else 0
            files["test"] += [(images[i], index) for i in sorted(order[:n_test])]
            files["train"] += [(images[i], index) for i in sorted(order[n_test:])]
    if len(classes) < 2 or not files["train"]:
        raise DataError(f"--data {directory}: expected class sub-folders holding PNG/JPEG "
                        f"images (found {len(classes)} folder(s), {len(files['train'])} "
                        f"images); or give {USER_FORMATS}")
    seen = {c for _, c in files["train"]}
    empty = [name for index, name in enumerate(classes) if index not in seen]
    if empty:
        where = directory / "train" if (directory / "train").is_dir() else directory
        raise DataError(f"{where / empty[0]}: no training images (PNG/JPEG) for class "
                        f"{empty[0]!r}; add some or remove the folder")
    mode, (width, height) = _image_mode([f for split in SPLITS for f, _ in files[split]],
                                        image_size)
    side = (image_size, image_size) if image_size else (height, width)
    channels = 3 if mode == "RGB" else 1
    # decoded pixels, stacked (a second copy), then floats: checked before any is decoded
    budget.check(sum(budget.array((len(files[split]), *side, channels), np.uint8, f"x_{split}")
                     + len(files[split]) * side[0] * side[1] * channels for split in splits),
                 f"--data {directory}: {' and '.join(f'{len(files[s]):,} {s}' for s in splits)}"
                 f" image(s) of {side[1]}x{side[0]}x{channels}",
                 "pass a smaller --image-size, or train on a subset" if image_size else
                 "pass --image-size PX to shrink them, or train on a subset", )
    arrays = {"y_" + split: np.array([c for _, c in files[split]], np.int64)
              for split in SPLITS}
    for split in splits:
        arrays["x_" + split] = _decode(files[split], mode, image_size)
    return _user_dataset("images", directory, arrays, classes)


def _image_mode(paths: List[Path], image_size: Optional[int] = None):
    """(RGB if any image has colour, else grayscale (L); the first image's (width,
    height)). Reads every file's header (both splits, on every rank): without
    ``image_size`` all must share one size."""
    from PIL import Image

    mode, first = "L", None
    for path in paths:
        try:
            with open_regular(path, DataError) as file, Image.open(file) as image:
                if image.mode not in ("1", "L", "LA", "I", "I;16", "F"):
                    mode = "RGB"
                size = image.size
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds
            raise DataError(f"{path}: not a readable image ({type(e).__name__}: {e}); "
                            "replace or remove it") from None
        if first is None:
            first = (path, size)
        elif not image_size and size != first[1]:
            raise DataError(f"{path}: image is {size[0]}x{size[1]} but {first[0]} is "
                            f"{first[1][0]}x{first[1][1]}; pass --image-size PX to resize "
                            "every image to PX x PX")
    return mode, first[1]


def _decode(files, mode: str, image_size: Optional[int]) -> np.ndarray:
    from PIL import Image

    out, first = [], None
    for path, _ in files:
        try:
            with open_regular(path, DataError) as file, Image.open(file) as image:
                image = image.convert(mode)
                if image_size:
                    image = image.resize((image_size, image_size), Image.BILINEAR)
                pixels = np.asarray(image, np.uint8)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{path}: not a readable image ({type(e).__name__}: {e}); "
                            "replace or remove it") from None
        if first is None:
            first = (path, pixels.shape)
        elif pixels.shape != first[1]:
            raise DataError(f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]} but "
                            f"{first[0]} is {first[1][1]}x{first[1][0]}; pass --image-size "
                            "PX to resize every image to PX x PX")
        out.append(pixels)
    return np.stack(out) if out else np.zeros((0, 1, 1), np.uint8)


# ---------------------------------------------------------------------------------------
# Loading for a run (collective)
# ---------------------------------------------------------------------------------------
def load(dataset: str, data_dir: Optional[str], comm, splits=SPLITS,
         seed: int = 0, synthetic_shape: Optional[dict] = None,
         user_data: Optional[str] = None, image_size: Optional[int] = None,
         shard: Optional[Tuple[int, int]] = None) -> Dataset:
    """Load ``splits`` of ``dataset`` on this rank. Collective over ``comm``.

    ``synthetic_shape`` (image_size, channels, num_classes, n_train, n_test)
    describes ``--dataset synthetic``; ``shard`` (workers, this worker's index) keeps
    only this worker's shard of the training split (see :func:`_finish`). Contract:
    every rank calls it with the same ``dataset``; on return every rank holds the same
    dataset (same name and training-set size), or every rank raises the first rank's
    error (naming that rank and host).
    """
    result, error = None, None
    budget = MemoryBudget.of(comm, shard)
    try:
        if user_data:
            result = _read_user_data(user_data, splits, image_size, budget)
        elif dataset in ("auto", "mnist"):
            result = _load_mnist(dataset, data_dir, comm, splits)
        elif dataset == "digits":
            result = _from_arrays("digits", "scikit-learn load_digits (8x8, upscaled)",
                                  digits_upscaled(seed))
        elif dataset == "synthetic":
            shape = dict(synthetic_shape)
            check_synthetic(shape, splits, budget)
            arrays = synthetic(seed=seed, splits=splits, **shape)
            size = (shape["image_size"], shape["image_size"], shape["channels"])
            result = Dataset("synthetic", f"random {size[0]}x{size[1]}x{size[2]} images, "
                             f"{shape['num_classes']} classes, seed {seed}",
                             shape["num_classes"], size, shape["n_train"], **arrays)
        else:
            raise UsageError(f"unknown dataset {dataset!r}")
    except (DataError, UsageError) as e:
        if e.everywhere:  # already agreed on inside
            raise
        error = e
    comm.agree(error)
    _agree_on_dataset(result, comm)
    for split in SPLITS:
        if split not in splits:
            setattr(result, "x_" + split, None)
            setattr(result, "y_" + split, None)
    return _finish(result, shard)


def _finish(dataset: Dataset, shard: Optional[Tuple[int, int]]) -> Dataset:
    """With ``shard`` (workers, index), the training split cut to that worker's shard (its
    own copy, so the whole set read can be freed); then pixels as float32 (uint8 scaled
    to 0..1). In that order: a worker never holds the whole training set as floats,
    four times the bytes of its pixels."""
    if shard is not None and dataset.y_train is not None:
        start, stop = shard_range(dataset.train_size, *shard)
        dataset.y_train = take_shard(dataset.y_train, start, stop)
        if dataset.x_train is not None:
            dataset.x_train = take_shard(dataset.x_train, start, stop)
    for key in ("x_train", "x_test"):
        x = getattr(dataset, key)
        if isinstance(x, np.ndarray):  # not RepeatingImages: synthetic pixels are floats
            setattr(dataset, key, _as_float32(x))
    return dataset


def _as_float32(x: np.ndarray) -> np.ndarray:
    """Examples as float32: uint8 pixels scaled to 0..1, other numbers as they are."""
    if x.dtype == np.uint8:
        out = x.astype(np.float32)
        out /= np.float32(255.0)  # in place: the same rounding as x / 255, one array
        return out
    return x.astype(np.float32, copy=False)


def check_synthetic(shape: dict, splits, budget: MemoryBudget, pool: int = 64) -> None:
    """UsageError if the synthetic data of ``shape`` (see :func:`synthetic`) will not
    fit in ``budget``: its pools of images (float32) and every example's label."""
    side, channels = shape["image_size"], shape["channels"]
    images = sum(min(pool, shape[f"n_{split}"]) for split in splits)
    budget.check(4.0 * images * side * side * channels
                 + 4.0 * (shape["n_train"] + shape["n_test"]),
                 f"--image-size {side}, --synthetic-size {shape['n_train']:,}: the synthetic "
                 f"data ({images} random {side}x{side}x{channels} images and "
                 f"{shape['n_train'] + shape['n_test']:,} labels)",
                 "use a smaller --image-size or --synthetic-size", UsageError)


def _load_mnist(dataset: str, data_dir: Optional[str], comm, splits) -> Dataset:
    # Each phase below is collective so that the download on one host and the
    # waiting on the others stay in step (and are bounded by comm's timeout).
    arrays, origin, error = None, "", None
    try:
        arrays, origin = local_mnist(data_dir, splits)
    except DataError as e:
        error = e
    comm.agree(error)
    hosts_needing = {h for h, needs in zip(comm.hosts, comm.allgather_objects(arrays is None))
                     if needs}
    download_error = None
    if comm.host in hosts_needing and comm.ranks_on_host()[0] == comm.rank:
        try:  # one rank per host downloads into the shared Keras cache
            download(mnist_url(), KERAS_CACHE, KERAS_MNIST_SHA256)
        except DataError as e:
            download_error = str(e)
    failures = [f for f in comm.allgather_objects(download_error) if f]
    if arrays is None and not failures:
        arrays, origin = local_mnist(None, splits)
        origin = f"{origin} (downloaded from {mnist_url()})"
    if arrays is not None:
        return _from_arrays("mnist", origin, arrays)
    if dataset == "mnist":
        raise DataError(f"MNIST not found and {failures[0]}; {HOW_TO_GET_MNIST}")
    result = _from_arrays("digits", "scikit-learn load_digits (8x8, upscaled)",
                          digits_upscaled(0))
    result.note = ("MNIST not found and the download failed; training on scikit-learn's "
                   "bundled 8x8 digits upscaled to 28x28 instead (" + HOW_TO_GET_MNIST + ")")
    return result


def _with_channels(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Images with a channel axis, labels as int32 (pixels become floats in _finish)."""
    out = {}
    for key, value in arrays.items():
        if key.startswith("x_"):
            out[key] = value[..., None] if value.ndim == 3 else value
        else:
            out[key] = value.astype(np.int32)
    return out


def _from_arrays(name: str, source: str, arrays: Dict[str, np.ndarray],
                 train_size: Optional[int] = None) -> Dataset:
    arrays = _with_channels(arrays)
    any_x = next(v for k, v in arrays.items() if k.startswith("x_"))
    if train_size is None:
        train_size = len(arrays["y_train"])
    return Dataset(name=name, source=source, num_classes=10,
                   input_shape=tuple(any_x.shape[1:]), train_size=train_size, **arrays)


def _agree_on_dataset(result: Dataset, comm) -> None:
    summaries = comm.allgather_objects((result.name, result.train_size, result.num_classes,
                                        result.input_shape))
    if len(set(summaries)) > 1:
        lines = [f"{comm.name(r)} has {name} with {size} training examples of shape "
                 f"{shape} in {classes} classes"
                 for r, (name, size, classes, shape) in enumerate(summaries)]
        raise DataError("ranks loaded different data (" + "; ".join(lines) + "); give every "
                        "host the same files (--data, or MNIST via --data-dir or "
                        "$MPITRAIN_DATA_DIR)")


# ---------------------------------------------------------------------------------------
# Sharding and batching
# ---------------------------------------------------------------------------------------
def shard_range(n_examples: int, workers: int, index: int) -> Tuple[int, int]:
    """[start, stop) of worker ``index``'s shard: disjoint, equal sizes, remainder dropped."""
    size = n_examples // workers
    return index * size, (index + 1) * size


def check_shards(n_examples: int, workers: int, batch_size: int) -> int:
    """Shard size per worker; UsageError if a worker would get no data or less than a batch."""
    size = n_examples // workers
    if size == 0:
        raise UsageError(f"{workers} workers but only {n_examples} training examples: every "
                         "worker would get no data; use fewer ranks (mpirun -np)")
    if batch_size > size:
        raise UsageError(f"--batch-size {batch_size} is larger than a worker's shard "
                         f"({size} examples = {n_examples} / {workers} workers); use "
                         f"--batch-size {size} or less")
    return size


def batches_per_epoch(shard_size: int, batch_size: int) -> int:
    """Steps in one pass over a shard; the last batch may be smaller."""
    return -(-shard_size // batch_size)


def epoch_batches(shard_size: int, batch_size: int, seed: int, worker: int,
                  epoch: int) -> Iterator[np.ndarray]:
    """Index arrays of one epoch over a shard, shuffled reproducibly per (seed, worker, epoch)."""
    order = np.random.default_rng([seed, worker, epoch]).permutation(shard_size)
    for start in range(0, shard_size, batch_size):
        yield order[start:start + batch_size]


def describe(ds: Dataset) -> List[str]:
    """Lines for the log: dataset, origin and any note the user must see."""
    lines = [f"dataset {ds.name} from {ds.source}"]
    if ds.note:
        lines.append(ds.note)
    return lines
