"""TFRecord files of ``tf.train.Example`` as ``mpitrain data pack`` reads them: a
directory of files whose names start with ``train`` (the training split) and with
``test``, ``valid``, ``validation``, ``val`` or ``eval`` (the test split), each record
an image and its label under the usual feature names:

* the image: ``image/encoded`` (TensorFlow's ImageNet and object-detection
  convention), ``image``, ``image_raw`` or ``encoded``: PNG, JPEG, GIF or BMP bytes,
  decoded by TensorFlow (grayscale or RGB as the first image is, ``--image-size``
  resizing every image, else all must share one size);
* the label: ``image/class/label``, ``label``, ``class`` or ``image/label``: one
  integer, a class index 0..K-1 (K: the largest label + 1 over both splits, so
  ImageNet's 1-based labels give 1,001 classes, class 0 unused).

Records are counted first by their framing alone (a file cut short is named then);
they are read with ``tf.data.TFRecordDataset``, which checks every record's CRC, the
training files in an order shuffled from ``--seed``, several at once and through a
shuffle buffer (records cannot be read in any order, as the other sources' examples
are). A record that is damaged, lacks the features or does not decode stops the pack
with one line naming it. TensorFlow is imported only here.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import DataError

IMAGE_KEYS = ("image/encoded", "image", "image_raw", "encoded")
LABEL_KEYS = ("image/class/label", "label", "class", "image/label")
TEST_PREFIXES = ("test", "validation", "valid", "val", "eval")
#: records read at once from this many files, and shuffled in a buffer of this many
INTERLEAVE, SHUFFLE_BUFFER = 8, 10_000


def tfrecord_files(directory: Path) -> Optional[Dict[str, List[Path]]]:
    """Each split's TFRecord files in ``directory``, if it holds any (by name:
    ``*.tfrecord*``, ``*.tfrec``, ``*-of-NNNNN``); DataError if a split has none."""
    found = sorted(p for p in directory.iterdir() if p.is_file() and (
        ".tfrecord" in p.name or p.suffix == ".tfrec" or re.search(r"-of-\d+$", p.name)))
    if not found:
        return None
    splits: Dict[str, List[Path]] = {"train": [], "test": []}
    for path in found:
        name = path.name.lower()
        if name.startswith("train"):
            splits["train"].append(path)
        elif name.startswith(TEST_PREFIXES):
            splits["test"].append(path)
    for split, files in splits.items():
        if not files:
            raise DataError(f"{directory}: TFRecord files but none for the {split} split; "
                            "name them train* and test* (or validation*, val*, eval*)")
    return splits


def count_records(path: Path) -> int:
    """Records in a TFRecord file, from their length headers alone; DataError if the
    file ends inside a record."""
    return len(record_spans(path)[0])


def record_spans(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    """(offset, length) of each record's data in a TFRecord file, from the framing
    alone (each record: an 8-byte length, its 4-byte CRC, the data, the data's CRC);
    DataError if the file ends inside a record."""
    size, offsets, lengths, offset = path.stat().st_size, [], [], 0
    with open(path, "rb") as f:
        while offset < size:
            header = f.read(12)
            if len(header) < 12:
                break
            length = struct.unpack("<Q", header[:8])[0]
            if offset + 12 + length + 4 > size:
                break
            offsets.append(offset + 12)
            lengths.append(length)
            offset += 12 + length + 4
            f.seek(offset)
    if offset != size:
        raise DataError(f"{path}: cut short inside record {len(offsets) + 1} (byte {offset} "
                        f"of {size}); copy or write it again")
    return np.array(offsets, np.int64), np.array(lengths, np.int64)


def first_example(path: Path) -> Tuple[str, str, bytes]:
    """(image key, label key, the first record's image bytes) of a file."""
    import tensorflow as tf

    for raw in tf.data.TFRecordDataset(str(path)).take(1):
        example = tf.train.Example.FromString(raw.numpy())
        features = example.features.feature
        image = next((k for k in IMAGE_KEYS if k in features), None)
        label = next((k for k in LABEL_KEYS if k in features), None)
        if image is None or label is None:
            raise DataError(f"{path}: its records have features {sorted(features)}; an image "
                            f"is one of {', '.join(IMAGE_KEYS)} and a label one of "
                            f"{', '.join(LABEL_KEYS)}")
        return image, label, features[image].bytes_list.value[0]
    raise DataError(f"{path}: holds no records")


def read_split(files: List[Path], keys: Tuple[str, str], shape: Tuple[int, ...],
               image_size: Optional[int], seed: Optional[int]) -> Iterator[Tuple[np.ndarray,
                                                                                 np.ndarray]]:
    """(uint8 images shaped ``shape``, labels) in chunks: the files in an order shuffled
    from ``seed`` and the records through a shuffle buffer, or in order (``seed``
    None); DataError naming the file for a record that is damaged or does not decode."""
    import tensorflow as tf

    image_key, label_key = keys
    order = list(files) if seed is None else \
        [files[i] for i in np.random.default_rng([seed, 13]).permutation(len(files))]
    spec = {image_key: tf.io.FixedLenFeature([], tf.string),
            label_key: tf.io.FixedLenFeature([], tf.int64)}

    def decode(raw):
        example = tf.io.parse_single_example(raw, spec)
        image = tf.io.decode_image(example[image_key], channels=shape[-1],
                                   expand_animations=False)
        if image_size:
            image = tf.cast(tf.round(tf.image.resize(image, (image_size, image_size))),
                            tf.uint8)
        return tf.ensure_shape(image, shape), example[label_key]

    records = tf.data.TFRecordDataset([str(p) for p in order],
                                      num_parallel_reads=min(INTERLEAVE, len(order)))
    if seed is not None:
        records = records.shuffle(SHUFFLE_BUFFER, seed=seed)
    batches = records.map(decode, num_parallel_calls=tf.data.AUTOTUNE).batch(1024)
    try:
        for x, y in batches.as_numpy_iterator():
            yield x, y
    except tf.errors.OpError as e:
        where = ", ".join(str(p) for p in order) if len(order) <= 3 else \
            f"the {len(order)} files in {order[0].parent}"
        raise DataError(f"a record of {where} is damaged or does not decode as an "
                        f"image of {'x'.join(map(str, shape))} ({e.message.splitlines()[0]});"
                        " check the files, or pass --image-size PX where images differ in "
                        "size") from None


def image_shape(data: bytes, image_size: Optional[int]) -> Tuple[int, int, int]:
    """The shape every image is packed in, from the first one: its own size (or
    ``image_size`` square) and its channels (1 or 3)."""
    import tensorflow as tf

    try:
        image = tf.io.decode_image(data, expand_animations=False).numpy()
    except tf.errors.OpError as e:
        raise DataError(f"the first record's image does not decode ({e.message})") from None
    channels = 1 if image.shape[-1] in (1, 2) else 3
    height, width = (image_size, image_size) if image_size else image.shape[:2]
    return int(height), int(width), channels


def record_labels(path: Path, offsets: np.ndarray, lengths: np.ndarray, key: str) -> np.ndarray:
    """Each record's integer label under ``key``; DataError naming the first record
    that is not a tf.train.Example with one."""
    import tensorflow as tf

    labels = np.empty(len(offsets), np.int64)
    with open(path, "rb") as f:
        for i, (offset, length) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            f.seek(offset)
            try:
                feature = tf.train.Example.FromString(f.read(length)).features.feature[key]
                labels[i] = feature.int64_list.value[0]
            except Exception:  # noqa: BLE001 - protobuf's DecodeError, an empty list...
                raise DataError(f"{path}: record {i + 1} is not a tf.train.Example with an "
                                f"integer {key}") from None
    return labels
