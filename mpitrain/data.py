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

Images are float32 in [0, 1] shaped (N, H, W, C); labels are int32.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .errors import DataError, UsageError

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


# ---------------------------------------------------------------------------------------
# File formats
# ---------------------------------------------------------------------------------------
def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped); raise :class:`DataError` naming it if bad."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({e}); the file is corrupt or truncated, "
                        "replace it") from None
    return parse_idx(raw, str(path))


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
            if candidate.is_file():
                return candidate
    return None


def _keys(splits) -> List[str]:
    # training labels always: they are small and give every rank the training-set size
    keys = [prefix + split for split in splits for prefix in ("x_", "y_")]
    return keys if "y_train" in keys else keys + ["y_train"]


def read_mnist_dir(directory: Path, splits=SPLITS) -> Dict[str, np.ndarray]:
    """The MNIST arrays of ``splits`` from IDX files or ``mnist.npz`` in ``directory``."""
    found = {key: _find_idx(directory, IDX_NAMES[key]) for key in _keys(splits)}
    if all(found.values()):
        arrays = {key: read_idx(path) for key, path in found.items()}
        origin = str(directory)
    elif (directory / "mnist.npz").is_file():
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
        with np.load(path, allow_pickle=False) as f:
            return {key: np.asarray(f[key]) for key in _keys(splits)}
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
    if cache.is_file():
        arrays = read_npz(cache, splits)
        check_mnist_arrays(arrays, str(cache))
        return arrays, str(cache)
    return None, ""


def download(url: str, dest: Path, sha256: str, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to ``dest`` atomically, verifying its SHA-256; DataError if it fails."""
    dest = Path(dest).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise DataError(f"download of {url}: SHA-256 {digest.hexdigest()} does not match "
                            f"the expected {sha256}; the mirror or the transfer is corrupt")
        os.replace(tmp, dest)
    except OSError as e:  # URLError, timeouts and disk errors are all OSErrors
        raise DataError(f"cannot download {url} ({getattr(e, 'reason', e)})") from None
    finally:
        tmp.unlink(missing_ok=True)
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
# Loading for a run (collective)
# ---------------------------------------------------------------------------------------
def load(dataset: str, data_dir: Optional[str], comm, splits=SPLITS,
         seed: int = 0, synthetic_shape: Optional[dict] = None) -> Dataset:
    """Load ``splits`` of ``dataset`` on this rank. Collective over ``comm``.

    ``synthetic_shape`` (image_size, channels, num_classes, n_train, n_test)
    describes ``--dataset synthetic``. Contract: every rank calls it with the same ``dataset``; on return every rank
    holds the same dataset (same name and training-set size), or every rank raises
    the first rank's error (naming that rank and host).
    """
    result, error = None, None
    try:
        if dataset in ("auto", "mnist"):
            result = _load_mnist(dataset, data_dir, comm, splits)
        elif dataset == "digits":
            result = _from_arrays("digits", "scikit-learn load_digits (8x8, upscaled)",
                                  digits_upscaled(seed))
        elif dataset == "synthetic":
            shape = dict(synthetic_shape)
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
    return result


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


def _as_float(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    out = {}
    for key, value in arrays.items():
        if key.startswith("x_"):
            if value.dtype == np.uint8:
                value = value.astype(np.float32) / np.float32(255.0)
            out[key] = value[..., None] if value.ndim == 3 else value
        else:
            out[key] = value.astype(np.int32)
    return out


def _from_arrays(name: str, source: str, arrays: Dict[str, np.ndarray],
                 train_size: Optional[int] = None) -> Dataset:
    arrays = _as_float(arrays)
    any_x = next(v for k, v in arrays.items() if k.startswith("x_"))
    if train_size is None:
        train_size = len(arrays["y_train"])
    return Dataset(name=name, source=source, num_classes=10,
                   input_shape=tuple(any_x.shape[1:]), train_size=train_size, **arrays)


def _agree_on_dataset(result: Dataset, comm) -> None:
    summaries = comm.allgather_objects((result.name, result.train_size))
    if len(set(summaries)) > 1:
        lines = [f"{comm.name(r)} has {name} with {size} training images"
                 for r, (name, size) in enumerate(summaries)]
        raise DataError("ranks loaded different data (" + "; ".join(lines) + "); give every "
                        "host the same MNIST files (--data-dir or $MPITRAIN_DATA_DIR)")


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
