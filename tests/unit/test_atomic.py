"""mpitrain.atomic: a replaced file is the old one or the new one, fsynced before the rename."""

import json
import os

import numpy as np
import pytest

from mpitrain import atomic
from mpitrain.run.checkpoint import Checkpoint


def test_writes_fsyncs_then_renames(tmp_path, monkeypatch):
    target = tmp_path / "status.json"
    target.write_text("old")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(atomic.os, "replace",
                        lambda a, b: (events.append(("replace", a.name)), real_replace(a, b)))
    atomic.write_json_atomic(target, {"b": 1, "a": float("nan"), "when": tmp_path})
    assert events == ["fsync", ("replace", ".status.json.tmp")]
    assert target.read_text() == json.dumps({"a": float("nan"), "b": 1, "when": str(tmp_path)},
                                            indent=2, sort_keys=True) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("old report\n")
    with pytest.raises(RuntimeError):
        with atomic.atomic_file(target) as f:
            f.write("half of a new rep")
            raise RuntimeError("disk full")
    assert target.read_text() == "old report\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_binary_and_own_temporary_name(tmp_path):
    target = tmp_path / "mnist.npz"
    seen = []
    with atomic.atomic_file(target, "wb", tmp_suffix=f".{os.getpid()}.part") as f:
        seen = [p.name for p in tmp_path.iterdir()]
        f.write(b"\x00\x01")
    assert seen == [f".mnist.npz.{os.getpid()}.part"] and target.read_bytes() == b"\x00\x01"
    atomic.write_text_atomic(tmp_path / "t.md", "é\n")
    assert (tmp_path / "t.md").read_text(encoding="utf-8") == "é\n"


def test_checkpoint_is_written_through_it(tmp_path, monkeypatch):
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (renamed.append(b), real_replace(a, b)))
    ckpt = Checkpoint(weights=np.arange(3, dtype=np.float32), optimizer={}, step=2,
                      wall_time_s=1.0)
    path = ckpt.save(tmp_path)
    assert renamed == [path] and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert np.array_equal(Checkpoint.load(tmp_path).weights, ckpt.weights)


def test_a_checkpoint_written_during_an_evaluation_replaces_the_old_one_after_it(tmp_path):
    """Checkpoint.save(meanwhile=...): the evaluation runs while the file is written, and
    until it returns the previous checkpoint is the one on disk (a run killed then
    resumes from a checkpoint whose curve rows are all written)."""
    old = Checkpoint(weights=np.zeros(3, np.float32), optimizer={}, step=1, wall_time_s=1.0)
    old.save(tmp_path)
    new = Checkpoint(weights=np.arange(300_000, dtype=np.float32), optimizer={}, step=2,
                     wall_time_s=2.0)
    seen = []

    def evaluate():
        seen.append(Checkpoint.load(tmp_path).step)
    new.save(tmp_path, meanwhile=evaluate)
    assert seen == [1]
    assert Checkpoint.load(tmp_path).step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]


def test_a_failed_evaluation_leaves_the_previous_checkpoint(tmp_path):
    Checkpoint(weights=np.zeros(3, np.float32), optimizer={}, step=1, wall_time_s=1.0) \
        .save(tmp_path)

    def evaluate():
        raise RuntimeError("evaluation failed")
    with pytest.raises(RuntimeError, match="evaluation failed"):
        Checkpoint(weights=np.ones(3, np.float32), optimizer={}, step=2, wall_time_s=2.0) \
            .save(tmp_path, meanwhile=evaluate)
    assert Checkpoint.load(tmp_path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]


def test_a_failed_write_is_raised_after_the_evaluation(tmp_path):
    """A write that fails (here: weights that cannot be read, as a full disk fails a
    write) does not cut the evaluation short; its error comes after, the old file stays."""
    Checkpoint(weights=np.zeros(3, np.float32), optimizer={}, step=1, wall_time_s=1.0) \
        .save(tmp_path)
    evaluated = []
    class Unreadable:
        def __array__(self, *args, **kwargs):
            raise OSError("No space left on device")
    bad = Checkpoint(weights=Unreadable(), optimizer={}, step=2, wall_time_s=2.0)
    with pytest.raises(OSError, match="No space left"):
        bad.save(tmp_path, meanwhile=lambda: evaluated.append(True))
    assert evaluated == [True] and Checkpoint.load(tmp_path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]
