"""Where the built-in datasets come from: MNIST, scikit-learn's digits, synthetic images.

MNIST is looked for in this order: ``--data-dir``, ``$MPITRAIN_DATA_DIR``, the Keras
cache (``~/.keras/datasets/mnist.npz``), then downloaded (Keras' URL, or
``$MPITRAIN_MNIST_URL`` for a mirror) with its SHA-256 checked: one rank per host
downloads, into that host's cache (:func:`load_mnist`, collective). A data directory
may hold the four standard IDX files (gzipped or raw) or ``mnist.npz``.
``--dataset auto`` falls back to scikit-learn's bundled 8x8 digits, upscaled to 28x28,
when none of these works (an offline machine), and says so; ``--dataset mnist`` fails
instead. ``--dataset synthetic`` is random images generated on every rank from the
seed, without I/O.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..atomic import atomic_file
from ..errors import DataError, UsageError
from ..userfiles import open_regular
from .memory import MemoryBudget
from .shards import SPLITS, Dataset

KERAS_MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
KERAS_MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
KERAS_CACHE = Path("~/.keras/datasets/mnist.npz")

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
        arrays = {key: read_idx(path) for key, path in found.items() if path is not None}
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


def load_mnist(dataset: str, data_dir: Optional[str], comm, splits) -> Dataset:
    """MNIST's ``splits`` from a local copy or the download, else (``dataset`` auto) the
    digits, with a note saying so. Collective over ``comm``: each phase is, so that the
    download on one host and the waiting on the others stay in step (and are bounded
    by comm's timeout); one rank per host downloads into the host's Keras cache."""
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
        try:
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
    result = digits(0)
    result.note = ("MNIST not found and the download failed; training on scikit-learn's "
                   "bundled 8x8 digits upscaled to 28x28 instead (" + HOW_TO_GET_MNIST + ")")
    return result


def digits(seed: int) -> Dataset:
    """``--dataset digits``: :func:`digits_upscaled` as a Dataset."""
    return _from_arrays("digits", "scikit-learn load_digits (8x8, upscaled)",
                        digits_upscaled(seed))


def synthetic_dataset(shape: dict, seed: int, splits, budget: MemoryBudget) -> Dataset:
    """``--dataset synthetic`` of ``shape`` (image_size, channels, num_classes, n_train,
    n_test), checked against ``budget`` first."""
    check_synthetic(shape, splits, budget)
    arrays: Dict[str, Any] = synthetic(seed=seed, splits=splits, **shape)
    size = (shape["image_size"], shape["image_size"], shape["channels"])
    return Dataset("synthetic", f"random {size[0]}x{size[1]}x{size[2]} images, "
                   f"{shape['num_classes']} classes, seed {seed}",
                   shape["num_classes"], size, shape["n_train"], **arrays)


def _with_channels(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Images with a channel axis, labels as int32 (pixels become floats once loaded)."""
    out = {}
    for key, value in arrays.items():
        if key.startswith("x_"):
            out[key] = value[..., None] if value.ndim == 3 else value
        else:
            out[key] = value.astype(np.int32)
    return out


def _from_arrays(name: str, source: str, given: Dict[str, np.ndarray]) -> Dataset:
    arrays: Dict[str, Any] = _with_channels(given)
    any_x = next(v for k, v in arrays.items() if k.startswith("x_"))
    return Dataset(name=name, source=source, num_classes=10,
                   input_shape=tuple(any_x.shape[1:]), train_size=len(arrays["y_train"]),
                   **arrays)
