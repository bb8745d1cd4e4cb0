"""``mpitrain data pack`` and ``mpitrain data check``: a dataset made into a shard set
(:mod:`.shardset`), and a shard set checked.

Pack reads an npz (x_train, y_train, x_test, y_test), MNIST's IDX files, CIFAR-10's
python batches or an image folder (as ``--data`` reads them: see :mod:`.decoding`),
TFRecord files of ``tf.train.Example`` (:mod:`.tfrecords`), or generates images
(``synthetic``), and writes each split as shards of about
``--shard-mb`` MB. The training examples are shuffled (from ``--seed``) before they
are cut into shards, so that every shard holds every class: the run's shuffle
(:mod:`.order`) mixes whole shards and windows of them, not a class-sorted folder. An
image folder or a set of TFRecords is decoded a shard at a time, so packing needs
memory for one shard, not for the dataset; the other sources are read whole. Shards
are written under temporary names and renamed, the manifest last: a pack that stops
leaves no manifest, so nothing reads a half-written set.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import DataError, UsageError
from .decoding import read_user
from .imagefolders import decode_images, image_mode, list_images
from .memory import MemoryBudget, available_memory
from .shards import SPLITS
from .shardset import (FORMAT, MANIFEST, VERSION, ShardSet, read_manifest, read_members,
                       shard_problem)
from .sources import _find_idx, read_mnist_dir
from . import recordstream, tfrecords
from .tfrecords import tfrecord_files

DEFAULT_SHARD_MB = 128
#: what pack reads, for the error that says a path is not there
PACKS = ("an npz, MNIST's IDX files' directory, CIFAR-10's batches, an image folder, a "
         "directory of TFRecord files, or 'synthetic'")
SYNTHETIC = "synthetic"
#: a chunk of examples as a source yields it: (x, y)
Chunk = Tuple[np.ndarray, np.ndarray]


class Source:
    """What pack reads: each split's size and examples in chunks, the example shape and
    dtype, the classes."""

    def __init__(self, sizes: Dict[str, int], input_shape: Tuple[int, ...], dtype,
                 num_classes: Optional[int], classes: Optional[List[str]],
                 chunks: Callable[[str, np.ndarray], Iterator[Chunk]], origin: str):
        self.sizes, self.input_shape, self.dtype = sizes, input_shape, np.dtype(dtype)
        #: None: the largest label + 1, found as the examples are packed
        self.num_classes, self.classes, self.origin = num_classes, classes, origin
        #: (split, the indices of its examples in the order to write them) -> chunks
        self.chunks = chunks


def open_source(src: str, image_size: Optional[int] = None,
                synthetic: Tuple[int, int, int, int] = (0, 28, 1, 10), seed: int = 0) -> Source:
    """The dataset at ``src`` (or ``synthetic``: (train examples, image size,
    channels, classes)) as pack reads it; DataError naming what is wrong."""
    if src == SYNTHETIC:
        return _synthetic_source(*synthetic, seed)
    where = Path(src).expanduser().absolute()
    if not where.exists():
        raise DataError(f"{where}: no such file or directory; give {PACKS}")
    if (where / MANIFEST).exists():
        raise UsageError(f"{where}: is a shard set already; --data streams it as it is")
    if where.is_dir() and _find_idx(where, "train-images-idx3-ubyte"):
        arrays = read_mnist_dir(where)
        return _array_source({k: (v[..., None] if k.startswith("x_") else v)
                              for k, v in arrays.items()}, 10, None, str(where))
    records = tfrecord_files(where) if where.is_dir() else None
    if records:
        return _tfrecord_source(where, records, image_size, seed)
    if where.is_dir() and not _is_cifar(where):
        return _image_source(where, image_size)
    budget = MemoryBudget(available_memory())
    ds = read_user(str(where), SPLITS, image_size, budget)
    return _array_source({"x_train": ds.x_train, "y_train": ds.y_train, "x_test": ds.x_test,
                          "y_test": ds.y_test}, ds.num_classes, ds.classes, str(where))


def _is_cifar(where: Path) -> bool:
    from .decoding import _cifar_dir

    return _cifar_dir(where) is not None


def _array_source(arrays: Dict, num_classes: int, classes, origin: str) -> Source:
    def chunks(split: str, order: np.ndarray) -> Iterator[Chunk]:
        x, y = arrays["x_" + split], arrays["y_" + split]
        for start in range(0, len(order), 4096):
            idx = order[start:start + 4096]
            yield np.asarray(x[idx]), np.asarray(y[idx])

    x = arrays["x_train"]
    return Source({s: len(arrays["y_" + s]) for s in SPLITS}, tuple(x.shape[1:]), x.dtype,
                  num_classes, classes, chunks, origin)


def _image_source(directory: Path, image_size: Optional[int]) -> Source:
    classes, files = list_images(directory)
    mode, (width, height) = image_mode([f for s in SPLITS for f, _ in files[s]], image_size)
    side = (image_size, image_size) if image_size else (height, width)

    def chunks(split: str, order: np.ndarray) -> Iterator[Chunk]:
        for start in range(0, len(order), 256):
            part = [files[split][i] for i in order[start:start + 256]]
            x = decode_images(part, mode, image_size)
            yield (x[..., None] if x.ndim == 3 else x), np.array([c for _, c in part])

    shape = (*side, 3 if mode == "RGB" else 1)
    return Source({s: len(files[s]) for s in SPLITS}, shape, np.uint8, len(classes), classes,
                  chunks, str(directory))


def _tfrecord_source(directory: Path, files: Dict[str, List[Path]],
                     image_size: Optional[int], seed: int) -> Source:
    from . import tfrecords

    image_key, label_key, first = tfrecords.first_example(files["train"][0])
    shape = tfrecords.image_shape(first, image_size)

    def chunks(split: str, order: np.ndarray) -> Iterator[Chunk]:
        return tfrecords.read_split(files[split], (image_key, label_key), shape, image_size,
                                    seed if split == "train" else None)

    sizes = {split: sum(tfrecords.count_records(p) for p in paths)
             for split, paths in files.items()}
    return Source(sizes, shape, np.uint8, None, None, chunks, str(directory))


def _synthetic_source(n_train: int, image_size: int, channels: int, num_classes: int,
                      seed: int = 0) -> Source:
    """Learnable images: each class a fixed pattern, each example it plus noise."""
    shape = (image_size, image_size, channels)
    patterns = np.random.default_rng([seed, 7]).integers(0, 128, (num_classes, *shape),
                                                          dtype=np.uint8)
    sizes = {"train": n_train, "test": max(num_classes, n_train // 6)}

    def chunks(split: str, order: np.ndarray) -> Iterator[Chunk]:
        for start in range(0, len(order), 1024):
            idx = order[start:start + 1024]
            rng = np.random.default_rng([seed, SPLITS.index(split), int(idx[0])])
            y = (idx * 7919 + SPLITS.index(split)) % num_classes
            noise = rng.integers(0, 128, (len(idx), *shape), dtype=np.uint8)
            yield patterns[y] + noise, y  # (at most 127 + 127: no overflow)

    return Source(sizes, shape, np.uint8, num_classes, None, chunks, SYNTHETIC)


def pack(source: Source, dest: Path, shard_mb: float = DEFAULT_SHARD_MB, seed: int = 0,
         progress: Callable[[str], None] = lambda line: None) -> dict:
    """Write ``source`` as a shard set in ``dest`` (which must not hold one); returns
    the manifest."""
    if shard_mb <= 0:
        raise UsageError(f"--shard-mb {shard_mb:g}: give a positive size")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest}: exists and is not empty; remove it or pack into a new "
                         "directory")
    dest.mkdir(parents=True, exist_ok=True)
    row = int(np.prod(source.input_shape)) * source.dtype.itemsize
    per_shard = max(1, int(shard_mb * 2**20) // row)
    splits, top = {}, -1
    for split in SPLITS:
        n = source.sizes[split]
        order = (np.random.default_rng([seed, 11]).permutation(n) if split == "train"
                 else np.arange(n))
        count = max(1, -(-n // per_shard))
        shards = []
        chunks = source.chunks(split, order)
        pending: List[Chunk] = []
        for i in range(count):
            x, y = _take(chunks, pending, min(per_shard, n - i * per_shard))
            if len(y) and y.min() < 0:
                raise DataError(f"{source.origin}: a {split} label is {int(y.min())}; "
                                "classes are 0..K-1")
            top = max(top, int(y.max()) if len(y) else -1)
            name = f"{split}-{i:05d}-of-{count:05d}.npz"
            shards.append(_write_shard(dest / name, x, y))
            progress(f"{split}: {i + 1}/{count} shard(s), "
                     f"{min(n, (i + 1) * per_shard):,} of {n:,} examples")
        splits[split] = {"examples": n, "shards": shards}
    manifest = {"format": FORMAT, "version": VERSION, "source": source.origin,
                "input_shape": list(source.input_shape), "dtype": source.dtype.str,
                "num_classes": source.num_classes or top + 1, "classes": source.classes,
                "seed": seed, "splits": splits}
    partial = dest / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(partial, dest / MANIFEST)
    return manifest


def _take(chunks: Iterator[Chunk], pending: List[Chunk], n: int) -> Chunk:
    """The next ``n`` examples of ``chunks`` (what is left over stays in ``pending``)."""
    have = sum(len(y) for _, y in pending)
    while have < n:
        x, y = next(chunks)
        pending.append((x, y))
        have += len(y)
    x = np.concatenate([c[0] for c in pending])
    y = np.concatenate([c[1] for c in pending])
    pending[:] = [(x[n:], y[n:])] if len(y) > n else []
    return x[:n], y[:n]


def _write_shard(path: Path, x: np.ndarray, y: np.ndarray) -> dict:
    partial = path.with_name("." + path.name + ".partial")
    with open(partial, "wb") as f:
        np.savez(f, x=np.ascontiguousarray(x), y=y.astype(np.int32))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return {"file": path.name, "examples": int(len(y)), "bytes": path.stat().st_size,
            "sha256": sha256(path)}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(directory: Path) -> List[str]:
    """Every problem of the shard set in ``directory``, a line each (none: it is
    whole): the manifest, then each shard's presence, size, checksum, arrays and
    labels."""
    try:
        manifest = read_manifest(directory)
        if manifest.get("kind") == recordstream.KIND:
            ShardSet.open(directory)  # (the index read and matched against the manifest)
            return recordstream.check_records(directory, manifest)
    except DataError as e:
        return [str(e)]
    shape, dtype = tuple(manifest["input_shape"]), np.dtype(manifest["dtype"])
    problems = []
    for split, entry in manifest["splits"].items():
        for s in entry["shards"]:
            path = directory / s["file"]
            problem = _shard_problem(path, s, shape, dtype, int(manifest["num_classes"]))
            if problem:
                problems.append(problem if problem.startswith(str(path)) else
                                f"{path}: {problem}")
        if sum(int(s["examples"]) for s in entry["shards"]) != int(entry.get("examples", -1)):
            problems.append(f"{directory / MANIFEST}: the {split} shards' counts do not add "
                            f"up to its {entry.get('examples')} examples")
    return problems


def _shard_problem(path: Path, entry: dict, shape, dtype, num_classes: int) -> Optional[str]:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != int(entry["bytes"]):
        return (f"{size} bytes where the manifest says {entry['bytes']} (truncated or "
                "replaced)")
    if sha256(path) != entry["sha256"]:
        return "its checksum differs from the manifest's (the file changed or is damaged)"
    try:
        problem = shard_problem(read_members(path), int(entry["examples"]), shape, dtype)
        if problem:
            return problem
        with np.load(path, allow_pickle=False) as f:
            y = f["y"]
    except (DataError, OSError, ValueError) as e:
        return str(e)
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        return f"labels {int(y.min())}..{int(y.max())} outside the classes 0..{num_classes - 1}"
    return None


def index_records(src: Path, dest: Path, image_size: Optional[int] = None,
                progress: Callable[[str], None] = lambda line: None) -> dict:
    """Index the TFRecord files in ``src`` into ``dest`` (see the module docstring);
    returns the manifest."""
    files = tfrecords.tfrecord_files(src)
    if not files:
        raise DataError(f"{src}: holds no TFRecord files (*.tfrecord*, *.tfrec, *-of-NNNNN)")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest}: exists and is not empty; remove it or index into a new "
                         "directory")
    dest.mkdir(parents=True, exist_ok=True)
    image_key, label_key, first = tfrecords.first_example(files["train"][0])
    shape = tfrecords.image_shape(first, image_size)
    splits, top = {}, -1
    for split, paths in files.items():
        shards: List[dict] = []
        columns: Dict[str, List[np.ndarray]] = {"offset": [], "length": [], "label": []}
        for i, path in enumerate(paths):
            offsets, lengths = tfrecords.record_spans(path)
            labels = tfrecords.record_labels(path, offsets, lengths, label_key)
            if len(labels) and labels.min() < 0:
                raise DataError(f"{path}: a label is {int(labels.min())}; classes are 0..K-1")
            top = max(top, int(labels.max()) if len(labels) else -1)
            columns["offset"].append(offsets)
            columns["length"].append(lengths)
            columns["label"].append(labels)
            shards.append({"file": str(path.absolute()), "examples": len(offsets),
                           "bytes": path.stat().st_size, "sha256": ""})
            records = sum(map(len, columns["label"]))
            progress(f"{split}: {i + 1}/{len(paths)} file(s), {records:,} records")
        index = f"index-{split}.npz"
        np.savez(dest / index, offset=np.concatenate(columns["offset"]),
                 length=np.concatenate(columns["length"]),
                 label=np.concatenate(columns["label"]))
        splits[split] = {"examples": sum(s["examples"] for s in shards), "shards": shards,
                         "index": index}
    manifest = {"format": FORMAT, "version": VERSION, "kind": recordstream.KIND, "source": str(src),
                "input_shape": list(shape), "dtype": "|u1", "num_classes": top + 1,
                "classes": None, "image_key": image_key, "image_size": image_size,
                "splits": splits}
    partial = dest / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(partial, dest / MANIFEST)
    return manifest
