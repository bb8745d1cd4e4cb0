"""A set of shard files (``mpitrain data pack``'s output) read by example, so that a
rank holds only the batches it trains on next, however large the set.

A shard set is a directory with ``manifest.json`` and shard files
``train-00000-of-00012.npz`` ... ``test-00000-of-00001.npz``, each an uncompressed npz
of ``x`` (examples: uint8 pixels or float32) and ``y`` (int labels). The manifest
lists each split's shards with their example counts, sizes and SHA-256 checksums, the
examples' shape and dtype and the classes (see :mod:`.packing`, which writes and checks
it). Opening a set checks the manifest and every shard's size (not its checksum:
``mpitrain data check`` does that); an example is then read with one ``pread`` from
where its row lies in the shard (the npz members are stored, not compressed), and a
shard's labels once, kept for the shards read last (not a memory map: see
docs/architecture.md, "Streamed examples read with pread, not a memory map").
"""

from __future__ import annotations

import glob
import json
import os
import queue
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import DataError
from .order import Deal, EpochOrder, window_for
from . import recordstream
from .memory import MemoryBudget
from .shards import Dataset, as_float32, eval_sample

MANIFEST = "manifest.json"
FORMAT = "mpitrain shards"
VERSION = 1
#: shards kept open (their file descriptors) and labels kept read, per split: those
#: of two windows of the shuffle (order.WINDOW_FILES each, and the ends)
OPEN_SHARDS = 40
#: the batches read ahead of training
PREFETCH = 4
#: the environment variable naming a directory where each worker writes the global ids
#: of every batch it trains on, a line per batch (for tests that count examples)
EXAMPLE_LOG = "MPITRAIN_EXAMPLE_LOG"


def check_fix(directory) -> str:
    return f"check it with 'mpitrain data check {directory}' or pack it again"


@dataclass(frozen=True)
class Shard:
    """One shard file as the manifest lists it."""

    path: Path
    examples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Member:
    """Where an npy array lies inside a stored npz: data offset, shape, dtype."""

    offset: int
    shape: Tuple[int, ...]
    dtype: np.dtype

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize


def read_members(path: Path) -> Dict[str, Member]:
    """The npy members of the npz at ``path`` by name (``x``, ``y``), located without
    reading their data; DataError if one is compressed or not a C-order array."""
    members = {}
    with open(path, "rb") as f:
        try:
            infos = zipfile.ZipFile(f).infolist()
        except (zipfile.BadZipFile, OSError) as e:
            raise DataError(f"{path}: not a readable npz ({e})") from None
        for info in infos:
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if info.compress_type != zipfile.ZIP_STORED:
                raise DataError(f"{path}: member {info.filename} is compressed; a shard's "
                                "arrays must be stored (np.savez, not savez_compressed): "
                                "pack it with 'mpitrain data pack'")
            f.seek(info.header_offset)
            local = f.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise DataError(f"{path}: member {info.filename}'s header is damaged")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            try:
                version = np.lib.format.read_magic(f)
                shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version ==
                                         (1, 0) else np.lib.format.read_array_header_2_0(f))
            except ValueError as e:
                raise DataError(f"{path}: member {info.filename} is not an array ({e})") \
                    from None
            if fortran or dtype.hasobject:
                raise DataError(f"{path}: member {info.filename} is not a C-order array of "
                                "numbers")
            members[name] = Member(f.tell(), tuple(shape), dtype)
    return members


class Split:
    """One split of a shard set (``train`` or ``test``), read by example."""

    def __init__(self, directory: Path, name: str, shards: List[Shard],
                 input_shape: Tuple[int, ...], dtype: np.dtype):
        self.directory, self.name, self.shards = directory, name, shards
        self.input_shape, self.dtype = input_shape, dtype
        self._open: "OrderedDict[int, Tuple[int, Member, np.ndarray]]" = OrderedDict()
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return sum(s.examples for s in self.shards)

    @property
    def counts(self) -> Tuple[int, ...]:
        return tuple(s.examples for s in self.shards)

    def read(self, files: np.ndarray, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The examples (as stored) and labels (int32) at ``rows`` of ``files``, in that
        order; DataError naming the shard if one is missing or not as listed."""
        x = np.empty((len(rows),) + self.input_shape, dtype=self.dtype)
        y = np.empty(len(rows), dtype=np.int32)
        into = memoryview(x.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        for file in np.unique(files):
            where = np.flatnonzero(files == file)
            fd, member, labels = self._shard(int(file))
            y[where] = labels[rows[where]]
            size, offset = member.row_bytes, member.offset
            # one pread an example, into its row of the batch (a memoryview's slice: a
            # numpy row's buffer costs ten times the read)
            for i, row in zip(where.tolist(), rows[where].tolist()):
                if os.preadv(fd, [into[i * size:(i + 1) * size]], offset + row * size) != size:
                    raise self._short(file, offset + row * size)
        return x, y

    def _short(self, file, offset: int) -> DataError:
        return DataError(f"{self.shards[int(file)].path}: shorter than its manifest says (no "
                         f"example at byte {offset}); {check_fix(self.directory)}")

    def _shard(self, file: int) -> Tuple[int, Member, np.ndarray]:
        """The shard's open descriptor, its ``x`` member and its labels (kept for the
        last :data:`OPEN_SHARDS` shards read)."""
        with self._lock:
            if file in self._open:
                self._open.move_to_end(file)
                return self._open[file]
        opened = self._open_shard(file)
        with self._lock:
            self._open[file] = opened
            while len(self._open) > OPEN_SHARDS:
                os.close(self._open.popitem(last=False)[1][0])
        return opened

    def _open_shard(self, file: int) -> Tuple[int, Member, np.ndarray]:
        shard = self.shards[file]
        try:
            members = read_members(shard.path)
            problem = shard_problem(members, shard.examples, self.input_shape, self.dtype)
            if problem:
                raise DataError(f"{shard.path}: {problem}")
            fd = os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise DataError(f"{shard.path}: cannot be read ({e.strerror or e}); "
                            f"{check_fix(self.directory)}") from None
        except DataError as e:
            raise DataError(f"{e}; {check_fix(self.directory)}") from None
        y = members["y"]
        labels = np.empty(shard.examples, dtype=y.dtype)
        if os.preadv(fd, [memoryview(labels.view(np.uint8))], y.offset) != labels.nbytes:  # type: ignore[arg-type]
            os.close(fd)
            raise self._short(file, y.offset)
        return fd, members["x"], labels.astype(np.int32)

    def close(self) -> None:
        with self._lock:
            while self._open:
                os.close(self._open.popitem()[1][0])


def shard_problem(members: Dict[str, Member], examples: int, input_shape: Tuple[int, ...],
                  dtype: np.dtype) -> Optional[str]:
    """What is wrong with a shard's members against its manifest entry, if anything."""
    if set(members) != {"x", "y"}:
        return f"holds {sorted(members)}, not the arrays x and y"
    x, y = members["x"], members["y"]
    if x.shape != (examples,) + tuple(input_shape) or x.dtype != dtype:
        return (f"x is {x.dtype}{list(x.shape)}, the manifest says "
                f"{dtype}{[examples] + list(input_shape)}")
    if y.shape != (examples,) or y.dtype.kind not in "iu":
        return f"y is {y.dtype}{list(y.shape)}, not {examples} integer labels"
    return None


@dataclass
class ShardSet:
    """A shard set's manifest, checked: its splits, example shape, classes."""

    directory: Path
    input_shape: Tuple[int, ...]
    dtype: np.dtype
    num_classes: int
    classes: Optional[List[str]]
    splits: Dict[str, Split]

    @classmethod
    def open(cls, directory, train: Optional[List[str]] = None) -> "ShardSet":
        """The set in ``directory`` (with ``train``, only those of its training shards,
        by file name); DataError naming the problem if its manifest is missing or wrong,
        or a shard is missing or of another size than listed."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        if train is not None:
            entry = manifest["splits"]["train"]
            entry["shards"] = [s for s in entry["shards"] if s["file"] in train]
            if not entry["shards"] or manifest.get("kind") == recordstream.KIND:
                raise DataError(f"{directory}: no training shard of its manifest is among "
                                f"{', '.join(sorted(train)[:3])}...; a glob picks a packed "
                                "set's training shards (train-*.npz)")
        shape, dtype = tuple(manifest["input_shape"]), np.dtype(manifest["dtype"])
        splits: Dict[str, Split] = {}
        for name, entry in manifest["splits"].items():
            shards = [Shard(directory / s["file"], int(s["examples"]), int(s["bytes"]),
                            str(s["sha256"])) for s in entry["shards"]]  # (an absolute
            # "file" stays as it is: an indexed TFRecord set's files lie elsewhere)
            for shard in shards:
                size = _size(shard.path)
                if size != shard.bytes:
                    raise DataError(f"{shard.path}: " + (
                        "missing" if size is None else
                        f"{size} bytes where the manifest says {shard.bytes}") +
                        f"; {check_fix(directory)}")
            records = manifest.get("kind") == recordstream.KIND
            splits[name] = recordstream.open_split(directory, entry, manifest) if records \
                else Split(directory, name, shards, shape, dtype)  # type: ignore[assignment]
        return cls(directory, shape, dtype, int(manifest["num_classes"]),
                   manifest.get("classes"), splits)


def is_shard_set(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def glob_set(pattern: str) -> Optional[Tuple[Path, List[str]]]:
    """(the shard set's directory, the names of its files ``pattern`` matches) if
    ``pattern`` is a glob (``--data 'shards/train-000[0-7]*.npz'``: a subset of a set's
    training shards); None if it is no glob; DataError if it matches nothing or files
    outside one shard set's directory."""
    if not any(c in pattern for c in "*?[") or Path(pattern).exists():
        return None
    matched = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)))
    folders = {p.parent for p in matched}
    if len(folders) != 1 or not is_shard_set(next(iter(folders))):
        raise DataError(f"--data {pattern}: " + ("matches nothing" if not matched else
                        "matches files outside one shard set's directory") +
                        "; a glob picks training shards of one packed set")
    return next(iter(folders)), [p.name for p in matched]


def shard_dataset(directory: Path, splits, eval_examples: int,
                  budget: MemoryBudget, train: Optional[List[str]] = None) -> Dataset:
    """The shard set in ``directory`` as a run loads it: the train split to stream
    (``train_shards``; its labels are not read), the test split read if ``splits``
    has it: the ``eval_examples`` sample of it, or all of it, checked against
    ``budget`` first."""
    shards = ShardSet.open(directory, train)
    ds = Dataset("shards", str(directory), shards.num_classes, shards.input_shape,
                 shards.splits["train"].size, classes=shards.classes,
                 train_shards=shards.splits["train"])
    test = shards.splits.get("test")
    if "test" in splits:
        if test is None or not test.size:
            raise DataError(f"{directory}: the shard set has no test split; pack one with "
                            "it, the server evaluates on it")
        read_test_split(ds, test, eval_examples, budget, str(directory), "examples")
    return ds


def read_test_split(ds: Dataset, test, eval_examples: int, budget: MemoryBudget,
                    where: str, noun: str) -> None:
    """Into ``ds``: the ``eval_examples`` sample of ``test`` (a split read by example:
    :class:`Split` or its like), or all of it, checked against ``budget`` first (the
    examples as stored and their float32 copy); then ``test`` is closed."""
    keep = eval_sample(test.size, eval_examples)
    if len(keep) < test.size:
        ds.test_split_size = test.size
    row = int(np.prod(test.input_shape)) * test.dtype.itemsize
    budget.check(len(keep) * (row + (4 * row // test.dtype.itemsize)),
                 f"{where}: the {len(keep):,} test {noun}",
                 "pass --eval-examples N to evaluate on a sample of them")
    ds.x_test, ds.y_test = test.read(*EpochOrder(test.counts).locate(keep))
    test.close()


def read_manifest(directory: Path) -> dict:
    """The manifest of the set in ``directory``, its fields checked for presence and
    type; DataError naming the first that is wrong."""
    where = directory / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: not a readable manifest ({e}); "
                        f"{check_fix(directory)}") from None
    try:
        if manifest.get("format") != FORMAT or int(manifest.get("version", 0)) > VERSION:
            raise ValueError(f"format {manifest.get('format')!r} version "
                             f"{manifest.get('version')!r}, not {FORMAT!r} <= {VERSION}")
        if int(manifest["num_classes"]) < 1 or "train" not in manifest["splits"]:
            raise ValueError("no classes or no train split")
        kind = manifest.get("kind", "npz")
        if kind not in ("npz", recordstream.KIND):
            raise ValueError(f"kind {kind!r}")
        for entry in manifest["splits"].values():
            for s in entry["shards"]:
                if int(s["examples"]) < 0 or not str(s["file"]) or (
                        kind == "npz" and "/" in str(s["file"])):
                    raise ValueError(f"bad shard entry {s}")
        np.dtype(manifest["dtype"])
        [int(d) for d in manifest["input_shape"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{where}: not an mpitrain shard manifest ({type(e).__name__}: "
                        f"{e}); {check_fix(directory)}") from None
    return manifest


def _size(path: Path) -> Optional[int]:
    try:
        return path.stat().st_size
    except OSError:
        return None


class StreamedTrain:
    """A worker's training examples, read from a shard set's train split as it trains
    (see :mod:`.order` for which and in what order). Contract: every worker of the run
    makes one with the same ``workers``, ``seed`` and ``window`` and its own ``worker``
    index; together they train on every example at most once an epoch."""

    def __init__(self, split: Split, workers: int, worker: int, seed: int,
                 timeout: float, window: Optional[int] = None, prefetch: int = PREFETCH):
        self.split, self.workers, self.worker = split, workers, worker
        self.order = EpochOrder(split.counts, seed, window or window_for(split.counts))
        self.timeout, self.prefetch = timeout, prefetch
        self.log = _example_log(worker)

    def __len__(self) -> int:
        """Examples this worker trains on an epoch."""
        return self.split.size // self.workers

    def batch_ids(self, deal: Deal, epoch: int, batch: int) -> np.ndarray:
        return self.order.ids(epoch, *deal.positions(self.worker, batch))

    def epoch(self, batch_size: int, epoch: int, first: int = 0
              ) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """(x float32, y int32) of this worker's batches ``first``.. of ``epoch``, read
        ahead in a thread; DataError if a read fails or makes no progress for
        ``timeout`` seconds."""
        deal = Deal(self.split.size, self.workers, batch_size)

        def read(batch: int):
            ids = self.batch_ids(deal, epoch, batch)
            x, y = self.split.read(*self.order.locate(ids))
            return ids, as_float32(x), y

        for ids, x, y in read_ahead((read(b) for b in range(first, deal.batches)),
                                    self.prefetch, self.timeout,
                                    f"the shards in {self.split.directory}"):
            if self.log is not None:
                self.log.write(f"{epoch} {' '.join(map(str, ids.tolist()))}\n")
            yield x, y


def _example_log(worker: int):
    where = os.environ.get(EXAMPLE_LOG)
    if not where:
        return None
    return open(Path(where) / f"worker-{worker}.txt", "a", buffering=1)


def read_ahead(items: Iterator, depth: int, timeout: float, what: str) -> Iterator:
    """``items`` produced in a background thread, at most ``depth`` ahead of the
    consumer; the producer's error is raised here, and DataError if it produced nothing
    for ``timeout`` seconds (a stalled file system). Stopping early (closing the
    generator) stops the thread."""
    ahead: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def offer(item) -> bool:
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in items:
                if not offer((item, None)):
                    return
            offer((end, None))
        except BaseException as e:  # noqa: B902 - handed to the consumer, which raises it
            offer((end, e))

    thread = threading.Thread(target=produce, name="mpitrain-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, error = ahead.get(timeout=timeout)
            except queue.Empty:
                raise DataError(f"reading {what} made no progress for {timeout:g} s (a "
                                "stalled file system?); check the storage, or raise "
                                "--timeout") from None
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stop.set()
