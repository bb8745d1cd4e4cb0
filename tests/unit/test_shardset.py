"""Shard sets (mpitrain/data/shardset.py, packing.py) on real files: packed from an npz of
the real MNIST and from an image folder, read back example by example as the workers
stream them (every example once, the data unchanged), and every bad set named by
``mpitrain data check`` and refused with one line by a run."""

import hashlib
import io
import json
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mpitrain.data import packing
from mpitrain.data.decoding import read_user
from mpitrain.data.memory import MemoryBudget
from mpitrain.data.shards import SPLITS
from mpitrain.data.shardset import MANIFEST, ShardSet, StreamedTrain, read_ahead
from mpitrain.errors import DataError, UsageError
from unit.test_user_data import write_images, write_mnist_npz

BIG = MemoryBudget(1 << 40)


@pytest.fixture(scope="module")
def mnist_npz(tmp_path_factory):
    return write_mnist_npz(tmp_path_factory.mktemp("npz") / "m.npz", n_train=3001, n_test=500)


@pytest.fixture
def packed(mnist_npz, tmp_path):
    """3,001 MNIST digits in shards of 0.5 MB (about 640 examples: uneven, the last short)."""
    dest = tmp_path / "shards"
    packing.pack(packing.open_source(str(mnist_npz)), dest, shard_mb=0.5, seed=4)
    return dest


def row_hashes(x, y):
    return Counter(hashlib.sha1(row.tobytes()).hexdigest() + f":{label}"
                   for row, label in zip(np.ascontiguousarray(x), y))


def test_pack_writes_shuffled_shards_and_a_manifest(packed, mnist_npz):
    manifest = json.loads((packed / MANIFEST).read_text())
    train = manifest["splits"]["train"]
    assert train["examples"] == 3001 and len(train["shards"]) == 5
    assert [s["file"] for s in train["shards"]][0] == "train-00000-of-00005.npz"
    assert sum(s["examples"] for s in train["shards"]) == 3001
    assert (manifest["input_shape"], manifest["num_classes"]) == ([28, 28, 1], 10)
    with np.load(packed / "train-00000-of-00005.npz") as f:
        assert f["x"].dtype == np.uint8 and len(np.unique(f["y"])) == 10  # mixed classes
    with np.load(mnist_npz) as f:
        source = row_hashes(f["x_train"], f["y_train"])
        first = f["y_train"][:640]
    with np.load(packed / "train-00000-of-00005.npz") as f:
        assert not np.array_equal(f["y"], first)  # shuffled
    assert packing.check(packed) == []
    assert sum(source.values()) == 3001


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_the_workers_stream_every_example_once_unchanged(packed, mnist_npz, workers):
    split = ShardSet.open(packed).splits["train"]
    seen = Counter()
    for w in range(workers):
        stream = StreamedTrain(split, workers, w, seed=2, timeout=30, window=1000)
        batches = list(stream.epoch(64, epoch=1))
        assert len(batches) == -(-(3001 // workers) // 64)
        for x, y in batches:
            assert x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
            seen += row_hashes(np.round(x * 255).astype(np.uint8), y)
    with np.load(mnist_npz) as f:
        source = row_hashes(f["x_train"][..., None], f["y_train"])
    assert sum(seen.values()) == workers * (3001 // workers)
    assert not seen - source  # nothing that is not in the source, nothing twice


def test_a_stream_from_a_later_batch_is_the_rest_of_the_epoch(packed):
    split = ShardSet.open(packed).splits["train"]
    stream = StreamedTrain(split, 2, 1, seed=0, timeout=30)
    whole = list(stream.epoch(100, epoch=4))
    rest = list(stream.epoch(100, epoch=4, first=9))
    assert len(rest) == len(whole) - 9
    for (a, b), (c, d) in zip(whole[9:], rest):
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_an_image_folder_is_packed_a_shard_at_a_time(tmp_path):
    images = write_images(tmp_path / "imgs", n=120, classes=3, channels=3, split=True)
    dest = tmp_path / "packed"
    manifest = packing.pack(packing.open_source(str(images)), dest, shard_mb=0.02)
    assert manifest["classes"] == ["c0", "c1", "c2"]
    assert manifest["input_shape"] == [24, 24, 3]
    assert len(manifest["splits"]["train"]["shards"]) > 3
    ds = read_user(str(dest), SPLITS, None, BIG)
    assert ds.name == "shards" and ds.train_size == 96 and ds.x_test.shape == (24, 24, 24, 3)
    assert ds.x_train is None and ds.train_shards is not None  # streamed, not read


def test_synthetic_data_is_packed_from_a_generator(tmp_path):
    source = packing.open_source(packing.SYNTHETIC, synthetic=(500, 8, 3, 4))
    manifest = packing.pack(source, tmp_path / "s", shard_mb=0.05)
    assert manifest["splits"]["train"]["examples"] == 500
    assert manifest["input_shape"] == [8, 8, 3] and manifest["num_classes"] == 4
    assert packing.check(tmp_path / "s") == []


def test_the_test_split_is_read_whole_or_as_its_sample(packed):
    whole = read_user(str(packed), ("test",), None, BIG)
    assert len(whole.y_test) == 500 and whole.test_split_size is None
    sample = read_user(str(packed), ("test",), None, BIG, eval_examples=120)
    assert len(sample.y_test) == 120 and sample.test_split_size == 500
    with pytest.raises(DataError, match="--eval-examples"):
        read_user(str(packed), ("test",), None, MemoryBudget(100_000))


def test_pack_refuses_a_directory_in_use_and_leaves_no_manifest_if_it_stops(packed,
                                                                          tmp_path):
    with pytest.raises(UsageError, match="not empty"):
        packing.pack(packing.open_source(packing.SYNTHETIC), packed)
    with pytest.raises(UsageError, match="is a shard set already"):
        packing.open_source(str(packed))
    with pytest.raises(DataError, match="nowhere: no such file or directory; give an npz"):
        packing.open_source(str(tmp_path / "nowhere"))
    source = packing.open_source(packing.SYNTHETIC, synthetic=(5000, 8, 1, 4))
    chunks = source.chunks

    def failing(split, order):
        yield next(chunks(split, order))
        raise DataError("image 7 cannot be decoded")

    source.chunks = failing
    with pytest.raises(DataError, match="image 7"):
        packing.pack(source, tmp_path / "cut", shard_mb=0.01)
    assert (tmp_path / "cut" / "train-00000-of-00031.npz").exists()
    assert not (tmp_path / "cut" / MANIFEST).exists()


def rewrite(path: Path, **arrays):
    np.savez(path, **arrays)


@pytest.mark.parametrize("damage,problem", [
    ("delete", "missing"),
    ("truncate", "bytes where the manifest says"),
    ("flip", "checksum differs"),
    ("labels", "outside the classes 0..9"),
    ("shape", "x is uint8[668, 28, 28], the manifest says uint8[668, 28, 28, 1]"),
    ("compressed", "is compressed"),
])
def test_check_names_every_damaged_shard(packed, damage, problem):
    shard = packed / "train-00001-of-00005.npz"
    with np.load(shard) as f:
        x, y = f["x"], f["y"]
    if damage == "delete":
        shard.unlink()
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[-50] ^= 0xFF
        shard.write_bytes(bytes(raw))
    else:
        if damage == "labels":
            y = y + 5
        if damage == "shape":
            x = x[..., 0]
        (np.savez_compressed if damage == "compressed" else np.savez)(shard, x=x, y=y)
        manifest = json.loads((packed / MANIFEST).read_text())  # as if packed so: only
        entry = manifest["splits"]["train"]["shards"][1]        # the arrays are wrong
        entry.update(bytes=shard.stat().st_size, sha256=packing.sha256(shard))
        (packed / MANIFEST).write_text(json.dumps(manifest))
    problems = packing.check(packed)
    assert len(problems) == 1 and problems[0].startswith(str(shard)), problems
    assert problem in problems[0]


def test_a_run_refuses_a_damaged_set_with_one_line(packed):
    (packed / "train-00002-of-00005.npz").write_bytes(b"PK")
    with pytest.raises(DataError, match=r"train-00002-of-00005.npz: 2 bytes where the "
                       r"manifest says \d+; check it with 'mpitrain data check"):
        read_user(str(packed), ("train",), None, BIG)
    (packed / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="manifest.json: not a readable manifest"):
        ShardSet.open(packed)
    (packed / MANIFEST).write_text(json.dumps({"format": "other"}))
    assert "not an mpitrain shard manifest" in packing.check(packed)[0]


def test_a_shard_damaged_after_the_start_is_named_when_read(packed):
    """Opened sets check sizes; a shard replaced by another of the same size is found
    when a worker reaches it."""
    split = ShardSet.open(packed).splits["train"]
    shard = packed / "train-00000-of-00005.npz"
    size = shard.stat().st_size
    with np.load(shard) as f:
        np.savez(shard, x=f["x"][:10], y=f["y"][:10])
    with open(shard, "ab") as f:
        f.write(b"\0" * (size - shard.stat().st_size))
    stream = StreamedTrain(split, 1, 0, seed=0, timeout=30)
    with pytest.raises(DataError, match="train-00000-of-00005.npz: not a readable npz .*"
                       "check it with 'mpitrain data check"):
        list(stream.epoch(3001, epoch=1))


def test_read_ahead_hands_on_errors_and_bounds_a_stall():
    def failing():
        yield 1
        raise DataError("shard gone")

    with pytest.raises(DataError, match="shard gone"):
        list(read_ahead(failing(), 2, 5, "x"))
    release = threading.Event()

    def stalled():
        yield 1
        release.wait(30)
        yield 2

    t0 = time.monotonic()
    items = read_ahead(stalled(), 2, 0.5, "the shards in /nfs")
    assert next(items) == 1
    with pytest.raises(DataError, match="reading the shards in /nfs made no progress for "
                       "0.5 s"):
        next(items)
    assert time.monotonic() - t0 < 5
    release.set()


def test_read_ahead_stops_its_thread_when_the_consumer_stops():
    produced = []

    def endless():
        for i in range(10_000):
            produced.append(i)
            yield i

    items = read_ahead(endless(), 2, 5, "x")
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    time.sleep(1.0)
    count = len(produced)
    time.sleep(0.5)
    assert len(produced) == count < 10  # stopped, a few read ahead at most


def test_stream_shards_gives_each_rank_its_own_batches_as_a_tf_dataset(packed, mnist_npz):
    import mpitrain

    seen, tested = Counter(), Counter()
    for rank in range(2):
        train, steps = mpitrain.stream_shards(packed, 100, rank, 2, seed=1)
        assert steps == 15  # 1,500 examples a rank
        batches = list(train.take(steps + 1).as_numpy_iterator())  # into the next epoch
        for x, y in batches[:steps]:
            seen += row_hashes(np.round(x * 255).astype(np.uint8), y)
        test, test_steps = mpitrain.stream_shards(packed, 64, rank, 2, split="test")
        for x, y in test.as_numpy_iterator():
            tested += row_hashes(np.round(x * 255).astype(np.uint8), y)
        assert test_steps == 4
    with np.load(mnist_npz) as f:
        assert not seen - row_hashes(f["x_train"][..., None], f["y_train"])
        assert tested == row_hashes(f["x_test"][..., None], f["y_test"])
    assert sum(seen.values()) == 3000
    with pytest.raises(UsageError, match="no 'valid' split"):
        mpitrain.stream_shards(packed, 10, 0, 1, split="valid")


def write_tfrecords(directory: Path, n: int = 300, files: int = 3, channels: int = 3,
                    image_key: str = "image/encoded", label_key: str = "image/class/label"):
    """TFRecord files of tf.train.Example (PNG bytes and a label), as an earlier
    TensorFlow pipeline writes them: train-0000i-of-0000N and one validation file.
    Returns {split: (x, y)} of what was written."""
    import tensorflow as tf
    from PIL import Image

    from unit.test_user_data import banded

    directory.mkdir(parents=True, exist_ok=True)
    x, y = banded(n, 5, 16, channels, classes=4)
    cut = n * 4 // 5
    written = {"train": (x[:cut], y[:cut]), "test": (x[cut:], y[cut:])}
    for split, (xs, ys) in written.items():
        parts = files if split == "train" else 1
        for part in range(parts):
            name = (f"train-{part:05d}-of-{parts:05d}" if split == "train"
                    else "validation-00000-of-00001")
            with tf.io.TFRecordWriter(str(directory / name)) as writer:
                for image, label in list(zip(xs, ys))[part::parts]:
                    png = io.BytesIO()
                    Image.fromarray(image[..., 0] if channels == 1 else image).save(png, "PNG")
                    feature = {image_key: tf.train.Feature(
                                   bytes_list=tf.train.BytesList(value=[png.getvalue()])),
                               label_key: tf.train.Feature(
                                   int64_list=tf.train.Int64List(value=[int(label)]))}
                    writer.write(tf.train.Example(features=tf.train.Features(
                        feature=feature)).SerializeToString())
    return written


def test_tfrecords_are_packed_and_stream_unchanged(tmp_path):
    written = write_tfrecords(tmp_path / "records")
    manifest = packing.pack(packing.open_source(str(tmp_path / "records")), tmp_path / "s",
                            shard_mb=0.1)
    assert (manifest["input_shape"], manifest["num_classes"]) == ([16, 16, 3], 4)
    assert [manifest["splits"][s]["examples"] for s in SPLITS] == [240, 60]
    assert packing.check(tmp_path / "s") == []
    split = ShardSet.open(tmp_path / "s").splits["train"]
    seen = Counter()
    for x, y in StreamedTrain(split, 1, 0, seed=0, timeout=30).epoch(50, 1):
        seen += row_hashes(np.round(x * 255).astype(np.uint8), y)
    assert seen == row_hashes(*written["train"])  # PNG: lossless, every record once
    test = read_user(str(tmp_path / "s"), ("test",), None, BIG)
    assert row_hashes(test.x_test, test.y_test) == row_hashes(*written["test"])  # (as stored)


def test_tfrecords_with_other_feature_names_and_grayscale(tmp_path):
    write_tfrecords(tmp_path / "r", n=50, files=1, channels=1, image_key="image",
                    label_key="label")
    manifest = packing.pack(packing.open_source(str(tmp_path / "r"), image_size=8),
                            tmp_path / "s")
    assert manifest["input_shape"] == [8, 8, 1]


@pytest.mark.parametrize("damage,message", [
    ("cut", "cut short inside record"),
    ("flip", "is damaged or does not decode"),
    ("features", "an image is one of image/encoded"),
    ("no test", "none for the test split"),
])
def test_bad_tfrecords_stop_the_pack_with_one_line(tmp_path, damage, message):
    records = tmp_path / "r"
    write_tfrecords(records, n=50, files=1, image_key="picture" if damage == "features"
                    else "image/encoded")
    train = records / "train-00000-of-00001"
    if damage == "cut":
        train.write_bytes(train.read_bytes()[:-7])
    elif damage == "flip":
        raw = bytearray(train.read_bytes())
        raw[len(raw) // 2] ^= 0x55  # inside a record's data: its CRC no longer matches
        train.write_bytes(bytes(raw))
    elif damage == "no test":
        (records / "validation-00000-of-00001").unlink()
    with pytest.raises(DataError, match=message):
        packing.pack(packing.open_source(str(records)), tmp_path / "s")
    assert not (tmp_path / "s" / MANIFEST).exists()


def test_an_image_folder_streams_with_stream(tmp_path):
    """--stream: the images decoded as the workers read them, the same pixels as the
    folder read whole, every one once an epoch over three workers."""
    folder = write_images(tmp_path / "imgs", n=90, classes=3, channels=3, split=True)
    whole = read_user(str(folder), SPLITS, None, BIG)
    streamed = read_user(str(folder), SPLITS, None, BIG, stream=True)
    assert streamed.x_train is None and streamed.train_shards.size == whole.train_size == 72
    assert (streamed.input_shape, streamed.num_classes) == (whole.input_shape, 3)
    assert np.array_equal(streamed.x_test, whole.x_test)
    seen = Counter()
    for w in range(3):
        for x, y in StreamedTrain(streamed.train_shards, 3, w, 0, 30).epoch(5, 1):
            seen += row_hashes(np.round(x * 255).astype(np.uint8), y)
    assert seen == row_hashes(whole.x_train, whole.y_train)
    sample = read_user(str(folder), ("test",), None, BIG, eval_examples=7, stream=True)
    assert len(sample.y_test) == 7 and sample.test_split_size == 18


def test_a_streamed_folder_names_an_image_of_another_size_or_broken(tmp_path, monkeypatch):
    from PIL import Image

    from mpitrain.data import imagestream

    folder = write_images(tmp_path / "imgs", n=40, classes=2, channels=1)
    odd = sorted((folder / "c1").iterdir())[-1]
    Image.new("L", (30, 30)).save(odd)
    with pytest.raises(DataError, match="image is 30x30 but .* is 24x24"):  # one sampled
        read_user(str(folder), ("train",), None, BIG, stream=True)
    monkeypatch.setattr(imagestream, "SAMPLE", 1)  # (a folder far larger than the sample)
    streamed = read_user(str(folder), ("train",), None, BIG, stream=True)
    # (named by the decoder when it meets both sizes, else when the batch is put together)
    with pytest.raises(DataError, match=r"(0039.png: image is 30x30 but .* is 24x24|images "
                       r"of 30x30 where the first is 24x24); pass --image-size"):
        list(StreamedTrain(streamed.train_shards, 1, 0, 0, 30).epoch(40, 1))
    odd.write_bytes(b"not a png")
    resized = read_user(str(folder), ("train",), 12, BIG, stream=True)
    with pytest.raises(DataError, match=f"{odd}: not a readable image"):
        list(StreamedTrain(resized.train_shards, 1, 0, 0, 30).epoch(40, 1))
    with pytest.raises(UsageError, match="--stream: .* is not an image folder"):
        read_user(str(write_mnist_npz(tmp_path / "m.npz", 100, 20)), SPLITS, None, BIG,
                  stream=True)


def test_indexed_tfrecords_stream_as_they_are(tmp_path, capsys):
    """mpitrain data index: the records read where they lie, by offset, every one once
    an epoch across the workers, the same pixels as written; data check reads every
    record's CRC; a file moved since is named."""
    from mpitrain.cli.commands import main

    written = write_tfrecords(tmp_path / "records", n=200)
    dest = tmp_path / "index"
    assert main(["data", "index", str(tmp_path / "records"), str(dest)]) == 0  # (in-process:
    out = capsys.readouterr().out                                 # TensorFlow is loaded)
    assert "160 train records, 40 test records" in out and "4 classes" in out
    assert packing.check(dest) == []
    ds = read_user(str(dest), SPLITS, None, BIG)
    assert (ds.name, ds.input_shape, ds.train_size) == ("shards", (16, 16, 3), 160)
    assert row_hashes(ds.x_test, ds.y_test) == row_hashes(*written["test"])
    seen = Counter()
    for w in range(3):
        for x, y in StreamedTrain(ds.train_shards, 3, w, 0, 30).epoch(8, 1):
            seen += row_hashes(np.round(x * 255).astype(np.uint8), y)
    assert sum(seen.values()) == 159 and not seen - row_hashes(*written["train"])
    train = tmp_path / "records" / "train-00001-of-00003"
    raw = bytearray(train.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    train.write_bytes(bytes(raw))
    problems = packing.check(dest)
    assert len(problems) == 1 and problems[0].startswith(f"{train}: ") and "corrupted" in \
        problems[0].lower(), problems
    train.rename(tmp_path / "elsewhere")
    with pytest.raises(DataError, match=f"{train}: missing; check it"):
        read_user(str(dest), ("train",), None, BIG)


def test_a_glob_picks_some_of_a_sets_training_shards(packed):
    manifest = json.loads((packed / MANIFEST).read_text())
    first_two = sum(s["examples"] for s in manifest["splits"]["train"]["shards"][:2])
    ds = read_user(str(packed / "train-0000[01]-of-*.npz"), SPLITS, None, BIG)
    assert ds.train_size == first_two and ds.train_shards.counts == (668, 668)
    assert len(ds.y_test) == 500  # the test split as the set has it
    with pytest.raises(DataError, match="matches nothing"):
        read_user(str(packed / "valid-*.npz"), SPLITS, None, BIG)
    with pytest.raises(DataError, match="no training shard of its manifest is among"):
        read_user(str(packed / "test-*.npz"), SPLITS, None, BIG)
