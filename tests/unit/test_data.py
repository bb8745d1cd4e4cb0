"""Dataset readers, resolution order, download checks and shard arithmetic."""

import gzip
import hashlib
import http.server
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import mnist_size
from mpitrain import data
from mpitrain.data import shards, sources
from mpitrain.errors import DataError, UsageError


def idx_bytes(array: np.ndarray) -> bytes:
    code = {np.uint8: 0x08, np.int32: 0x0C}[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_mnist(directory: Path, n_train=30, n_test=10, gz=True, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "y_train": rng.integers(0, 10, n_train, dtype=np.uint8),
              "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "y_test": rng.integers(0, 10, n_test, dtype=np.uint8)}
    for key, stem in sources.IDX_NAMES.items():
        raw = idx_bytes(arrays[key])
        if gz:
            (directory / (stem + ".gz")).write_bytes(gzip.compress(raw))
        else:
            (directory / stem).write_bytes(raw)
    return directory


class OneRank:
    """The communicator of a one-rank job: enough for data.load's collectives."""

    size, rank, host, hosts = 1, 0, "here", ["here"]

    def agree(self, error):
        if error is not None:
            raise error

    def allgather_objects(self, obj, kind="control"):
        return [obj]

    def ranks_on_host(self, host=None):
        return [0]

    def name(self, rank):
        return "rank 0 on here"


# ---- IDX ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    write_mnist(tmp_path, gz=gz)
    arrays = sources.read_mnist_dir(str(tmp_path))  # a str as well as a Path
    assert arrays["x_train"].shape == (30, 28, 28) and arrays["y_test"].shape == (10,)


def test_real_mnist_shapes(mnist):
    arrays = sources.read_mnist_dir(mnist)
    assert arrays["x_train"].shape == (mnist_size("train"), 28, 28)
    assert arrays["x_test"].shape == (mnist_size("test"), 28, 28)
    assert set(np.unique(arrays["y_train"])) == set(range(10))


def test_truncated_gzip_names_the_file(tmp_path):
    write_mnist(tmp_path)
    victim = tmp_path / "train-images-idx3-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:500])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz.*corrupt or truncated"):
        sources.read_mnist_dir(tmp_path)


def test_truncated_raw_idx_names_the_file(tmp_path):
    write_mnist(tmp_path, gz=False)
    victim = tmp_path / "t10k-images-idx3-ubyte"
    victim.write_bytes(victim.read_bytes()[:-7])
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte: IDX header announces"):
        sources.read_mnist_dir(tmp_path)


def test_bad_magic(tmp_path):
    write_mnist(tmp_path, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(DataError, match="not an IDX file"):
        sources.read_mnist_dir(tmp_path)


def test_not_gzip_at_all(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"this is not gzip")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: cannot read"):
        sources.read_mnist_dir(tmp_path)


def test_label_count_mismatch(tmp_path):
    write_mnist(tmp_path)
    labels = np.zeros(29, np.uint8)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    with pytest.raises(DataError, match="30 train images but labels of shape"):
        sources.read_mnist_dir(tmp_path)


def test_missing_files_listed(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError, match="missing t10k-images-idx3-ubyte"):
        sources.read_mnist_dir(tmp_path)


def test_npz_and_corrupt_npz(tmp_path):
    arrays = sources.read_mnist_dir(write_mnist(tmp_path / "idx"))
    np.savez(tmp_path / "mnist.npz", **arrays)
    assert sources.read_mnist_dir(tmp_path)["x_train"].shape == (30, 28, 28)
    (tmp_path / "mnist.npz").write_bytes((tmp_path / "mnist.npz").read_bytes()[:100])
    with pytest.raises(DataError, match="mnist.npz: cannot read"):
        sources.read_mnist_dir(tmp_path)


# ---- resolution order -------------------------------------------------------------------
def test_explicit_dir_beats_env_and_cache(tmp_path, monkeypatch):
    write_mnist(tmp_path / "flag", n_train=11)
    write_mnist(tmp_path / "env", n_train=12)
    monkeypatch.setenv("MPITRAIN_DATA_DIR", str(tmp_path / "env"))
    arrays, origin = sources.local_mnist(str(tmp_path / "flag"))
    assert len(arrays["y_train"]) == 11 and origin.endswith("flag")
    arrays, origin = sources.local_mnist(None)
    assert len(arrays["y_train"]) == 12 and origin.endswith("env")


def test_keras_cache_used_last(tmp_path, monkeypatch):
    monkeypatch.delenv("MPITRAIN_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert sources.local_mnist(None) == (None, "")
    arrays = sources.read_mnist_dir(write_mnist(tmp_path / "idx", n_train=13))
    cache = tmp_path / ".keras" / "datasets"
    cache.mkdir(parents=True)
    np.savez(cache / "mnist.npz", **arrays)
    found, origin = sources.local_mnist(None)
    assert len(found["y_train"]) == 13 and origin.endswith("mnist.npz")


def test_missing_explicit_dir_is_an_error(tmp_path):
    with pytest.raises(DataError, match="--data-dir .*nope: no such directory"):
        sources.local_mnist(str(tmp_path / "nope"))


def test_auto_falls_back_to_digits_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("MPITRAIN_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MPITRAIN_MNIST_URL", "http://127.0.0.1:9/mnist.npz")  # closed port
    ds = data.load("auto", None, OneRank())
    assert ds.name == "digits" and ds.x_train.shape[1:] == (28, 28, 1)
    assert "bundled 8x8 digits" in ds.note and "--data-dir" in ds.note
    with pytest.raises(DataError, match="MNIST not found.*--data-dir.*MPITRAIN_DATA_DIR.*"
                                        "mnist.npz"):
        data.load("mnist", None, OneRank())


# ---- download ---------------------------------------------------------------------------
@pytest.fixture
def http_dir(tmp_path):
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(served), **kw)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_verifies_checksum(http_dir, tmp_path):
    served, url = http_dir
    payload = b"x" * 100_000
    (served / "f.bin").write_bytes(payload)
    dest = tmp_path / "out" / "f.bin"
    sources.download(url + "/f.bin", dest, hashlib.sha256(payload).hexdigest())
    assert dest.read_bytes() == payload
    with pytest.raises(DataError, match="SHA-256 .* does not match"):
        sources.download(url + "/f.bin", tmp_path / "bad.bin", "0" * 64)
    assert not (tmp_path / "bad.bin").exists()
    assert not list((tmp_path).glob(".*.part"))


def test_download_from_mirror_with_wrong_file_is_rejected(http_dir, tmp_path, monkeypatch):
    served, url = http_dir
    arrays = sources.read_mnist_dir(write_mnist(tmp_path / "idx"))
    np.savez(served / "mnist.npz", **arrays)  # not the official file: checksum must fail
    monkeypatch.delenv("MPITRAIN_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MPITRAIN_MNIST_URL", url + "/mnist.npz")
    with pytest.raises(DataError, match="SHA-256"):
        data.load("mnist", None, OneRank())
    assert not (tmp_path / "home" / ".keras" / "datasets" / "mnist.npz").exists()


def test_download_unreachable():
    with pytest.raises(DataError, match="cannot download http://127.0.0.1:9/x"):
        sources.download("http://127.0.0.1:9/x", Path("/tmp/never"), "0" * 64, timeout=5)


# ---- shards and batches -----------------------------------------------------------------
@pytest.mark.parametrize("n,workers", [(20000, 1), (20000, 2), (20000, 3), (10, 3), (7, 7)])
def test_shards_are_disjoint_equal_and_cover(n, workers):
    ranges = [shards.shard_range(n, workers, i) for i in range(workers)]
    sizes = {stop - start for start, stop in ranges}
    assert len(sizes) == 1
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert len(covered) == len(set(covered)) == workers * (n // workers)


def test_check_shards_errors():
    assert shards.check_shards(20000, 3, 100) == 6666
    with pytest.raises(UsageError, match="every worker would get no data"):
        shards.check_shards(2, 3, 1)
    with pytest.raises(UsageError, match="larger than a worker's shard.*6666"):
        shards.check_shards(20000, 3, 7000)


@pytest.mark.parametrize("user", [False, True], ids=["mnist", "npz"])
def test_a_worker_keeps_its_shard_as_the_same_floats(tmp_path, user):
    """load(shard=...) cuts the training split before the pixels become floats: the
    worker's floats are bit for bit those of the whole set, sliced, in an array of its
    own (the whole set read can be freed); the other splits are as without a shard."""
    write_mnist(tmp_path / "m", n_train=200, n_test=4)
    arrays = sources.read_mnist_dir(tmp_path / "m")
    np.savez(tmp_path / "m.npz", **arrays)
    source = dict(data_dir=None, user_data=str(tmp_path / "m.npz")) if user else \
        dict(data_dir=tmp_path / "m")
    whole = data.load("mnist", comm=OneRank(), **source)
    worker = data.load("mnist", comm=OneRank(), shard=(3, 1), **source)
    start, stop = shards.shard_range(200, 3, 1)
    expected = arrays["x_train"][start:stop, :, :, None].astype(np.float32) / np.float32(255)
    assert worker.x_train.dtype == np.float32 and worker.x_train.base is None
    assert worker.x_train.tobytes() == expected.tobytes() == whole.x_train[start:stop].tobytes()
    assert worker.y_train.tolist() == whole.y_train[start:stop].tolist()
    assert worker.train_size == whole.train_size == 200
    assert worker.x_test.tobytes() == whole.x_test.tobytes()


def test_the_eval_sample_is_fixed_sorted_and_without_repeats():
    sample = shards.eval_sample(10_000, 500)
    assert len(sample) == len(set(sample.tolist())) == 500
    assert sample.tolist() == sorted(sample.tolist()) and 0 <= sample[0] and sample[-1] < 10_000
    assert sample.tolist() == shards.eval_sample(10_000, 500).tolist()  # any run, any rank
    assert sample[-1] > 5_000  # spread over the split, not its first examples
    for n in (0, 10_000, 20_000):  # off, or not fewer than the split: all of it
        assert shards.eval_sample(10_000, n).tolist() == list(range(10_000))


@pytest.mark.parametrize("dataset", ["mnist", "synthetic"])
def test_eval_examples_keeps_that_sample_of_the_test_split_only(tmp_path, dataset):
    """load(eval_examples=N) keeps the N sampled test examples (pixels and labels alike,
    as floats) and says the whole split's size; the training split is untouched."""
    write_mnist(tmp_path / "m", n_train=200, n_test=40)
    options = dict(data_dir=tmp_path / "m", comm=OneRank(), synthetic_shape=dict(
        image_size=8, channels=1, num_classes=10, n_train=200, n_test=40))
    whole = data.load(dataset, **options)
    sample = data.load(dataset, eval_examples=7, **options)
    keep = shards.eval_sample(40, 7)
    assert sample.x_test.dtype == np.float32 and len(sample.x_test) == len(sample.y_test) == 7
    assert sample.x_test.tobytes() == np.asarray(whole.x_test[keep]).tobytes()
    assert sample.y_test.tolist() == whole.y_test[keep].tolist()
    assert sample.test_split_size == 40 and whole.test_split_size is None
    assert np.asarray(sample.x_train[:]).tobytes() == np.asarray(whole.x_train[:]).tobytes()
    assert "evaluating on 7 of the 40 test examples" in " ".join(data.describe(sample))
    assert data.load(dataset, eval_examples=40, **options).test_split_size is None


def test_epoch_batches_cover_shard_once_and_are_reproducible():
    batches = list(shards.epoch_batches(1050, 100, seed=1, worker=2, epoch=3))
    assert len(batches) == shards.batches_per_epoch(1050, 100) == 11
    assert len(batches[-1]) == 50
    assert sorted(np.concatenate(batches)) == list(range(1050))
    again = list(shards.epoch_batches(1050, 100, seed=1, worker=2, epoch=3))
    assert all((a == b).all() for a, b in zip(batches, again))
    other = next(shards.epoch_batches(1050, 100, seed=1, worker=2, epoch=4))
    assert not (other == batches[0]).all()


def test_digits_fallback_shape():
    arrays = sources.digits_upscaled()
    assert arrays["x_train"].shape[1:] == (28, 28) and arrays["x_train"].dtype == np.uint8
    assert len(arrays["y_train"]) + len(arrays["y_test"]) == 1797
