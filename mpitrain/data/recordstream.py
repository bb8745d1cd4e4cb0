"""TFRecord files streamed as they are: ``mpitrain data index SRC DEST`` reads the
files once and writes DEST (:func:`.packing.index_records`), a shard set whose
manifest (``"kind": "tfrecord"``) names the files where they lie and whose index
(``index-train.npz``, ``index-test.npz``)
holds every record's file, offset, length and label; ``--data DEST`` then reads each
example with one ``pread`` of its record and decodes it (Pillow, four threads), so the
files need no copy (:mod:`.packing` makes one, decoded once: faster to train from).

The index is what makes the records readable in any order (:mod:`.order`: the
workers' batches are scattered over the files), and it gives the classes without a
pass over the data at every start. Indexing reads every record's label, checks the
files' framing and decodes the first image (for the shape: ``--image-size``, else its
own size; its channels). Not the records' CRCs: ``mpitrain data check DEST`` reads every
record with TensorFlow, which checks them.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import DataError
from .shards import SPLITS

KIND = "tfrecord"
#: threads parsing and decoding a batch's records
DECODERS = 4


class RecordFiles:
    """One split of an indexed TFRecord set, read by example (the interface of
    :class:`.shardset.Split`)."""

    def __init__(self, directory: Path, paths: List[Path], counts: Tuple[int, ...],
                 index: Dict[str, np.ndarray], shape: Tuple[int, ...], image_key: str,
                 image_size: Optional[int]):
        self.directory, self.paths, self.counts = directory, paths, counts
        self.input_shape, self.dtype = shape, np.dtype(np.uint8)
        self.image_key, self.image_size = image_key, image_size
        self.offset, self.length = index["offset"], index["length"]
        self.labels = index["label"].astype(np.int32)
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._fds: Dict[int, int] = {}
        self._pool = ThreadPoolExecutor(DECODERS, thread_name_prefix="mpitrain-records")

    @property
    def size(self) -> int:
        return int(sum(self.counts))

    def read(self, files: np.ndarray, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        ids = self.starts[files] + rows
        parts = np.array_split(np.arange(len(ids)), min(DECODERS, max(1, len(ids))))
        x = np.empty((len(ids), *self.input_shape), np.uint8)
        for _ in self._pool.map(lambda part: self._decode(files, ids, part, x), parts):
            pass
        return x, self.labels[ids]

    def _decode(self, files: np.ndarray, ids: np.ndarray, part: np.ndarray,
                into: np.ndarray) -> None:
        import tensorflow as tf
        from PIL import Image

        mode = "L" if self.input_shape[-1] == 1 else "RGB"
        for i in part.tolist():
            file, record = int(files[i]), int(ids[i])
            path = self.paths[file]
            data = os.pread(self._fd(file), int(self.length[record]), int(self.offset[record]))
            try:
                example = tf.train.Example.FromString(data)
                raw = example.features.feature[self.image_key].bytes_list.value[0]
                with Image.open(io.BytesIO(raw)) as opened:
                    image = opened.convert(mode)
                    if self.image_size:
                        image = image.resize((self.image_size, self.image_size),
                                             Image.BILINEAR)  # type: ignore[attr-defined]
                    pixels = np.asarray(image, np.uint8)
            except Exception as e:  # noqa: BLE001 - protobuf's, Pillow's many kinds
                raise DataError(f"{path}: record {record - int(self.starts[file]) + 1} does "
                                f"not decode ({type(e).__name__}: {e}); check it with "
                                f"'mpitrain data check {self.directory}'") from None
            shape: Tuple[int, ...] = pixels.shape
            pixels = pixels.reshape(shape[:2] + (-1,))
            if pixels.shape != self.input_shape:
                height, width = shape[0], shape[1]
                raise DataError(f"{path}: record {record - int(self.starts[file]) + 1} is an "
                                f"image of {width}x{height}, not "
                                f"{self.input_shape[1]}x{self.input_shape[0]}; index with "
                                "--image-size PX to resize every image")
            into[i] = pixels

    def _fd(self, file: int) -> int:
        if file not in self._fds:
            try:
                self._fds[file] = os.open(self.paths[file], os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise DataError(f"{self.paths[file]}: cannot be read ({e.strerror}); index "
                                "the files again if they moved") from None
        return self._fds[file]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def open_split(directory: Path, entry: dict, manifest: dict) -> RecordFiles:
    """A split of an indexed set, its index read (DataError if it is damaged)."""
    try:
        with np.load(directory / entry["index"], allow_pickle=False) as f:
            index = {k: f[k] for k in ("offset", "length", "label")}
    except Exception as e:  # noqa: BLE001 - missing, truncated, not an npz
        raise DataError(f"{directory / entry['index']}: unreadable ({type(e).__name__}: {e}); "
                        "index the files again") from None
    counts = tuple(int(s["examples"]) for s in entry["shards"])
    if len(index["offset"]) != sum(counts):
        raise DataError(f"{directory / entry['index']}: {len(index['offset'])} records where "
                        f"the manifest lists {sum(counts)}; index the files again")
    return RecordFiles(directory, [Path(s["file"]) for s in entry["shards"]], counts, index,
                       tuple(manifest["input_shape"]), manifest["image_key"],
                       manifest.get("image_size"))


def check_records(directory: Path, manifest: dict) -> List[str]:
    """Every problem of an indexed set's files: missing, resized, or a record whose CRC
    TensorFlow finds wrong."""
    import tensorflow as tf

    problems = []
    for split in SPLITS:
        for s in manifest["splits"].get(split, {}).get("shards", []):
            path = Path(s["file"])
            if not path.is_file() or path.stat().st_size != int(s["bytes"]):
                problems.append(f"{path}: " + ("missing" if not path.is_file() else
                                               "changed size since it was indexed"))
                continue
            try:
                for _ in tf.data.TFRecordDataset(str(path)):
                    pass
            except tf.errors.OpError as e:
                problems.append(f"{path}: {e.message.splitlines()[0]}")
    return problems
