"""Results files: never half-written, never overwritten, runs.csv grows columns safely."""

import csv
import json
import multiprocessing


import numpy as np

from mpitrain.run.checkpoint import Checkpoint
from mpitrain.results.run_dir import (CsvLog, NullResults, RunResults, append_run_row,
                                      new_run_dir)
from mpitrain.train.context import ResultsWriter


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_run_dirs_are_never_reused(tmp_path):
    a = new_run_dir(tmp_path, "lr-sync-np4")
    b = new_run_dir(tmp_path, "lr-sync-np4")
    assert a != b and a.is_dir() and b.is_dir()


def test_runs_csv_appends_and_widens(tmp_path):
    table = tmp_path / "runs.csv"
    append_run_row(table, {"run": "a", "acc": 0.9})
    append_run_row(table, {"run": "b", "acc": 0.8})
    append_run_row(table, {"run": "c", "acc": 0.7, "cpu_max": 55.0})
    got = rows(table)
    assert [r["run"] for r in got] == ["a", "b", "c"]
    assert got[0]["cpu_max"] == "" and got[2]["cpu_max"] == "55"
    assert not list(tmp_path.glob(".runs.csv.tmp"))


def _append_many(args):
    path, start = args
    for i in range(start, start + 25):
        append_run_row(path, {"run": f"r{i}", "value": i, f"col{i % 3}": i})


def test_runs_csv_concurrent_writers(tmp_path):
    table = tmp_path / "runs.csv"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(_append_many, [(table, k * 25) for k in range(4)])
    got = rows(table)
    assert sorted(int(r["value"]) for r in got) == list(range(100))


def test_curve_log_and_json(tmp_path):
    results = RunResults(tmp_path, "lr-single-np1")
    results.add_curve_row({"epoch": 1, "step": 10, "test_accuracy": 0.5})
    results.write_json("config.json", {"a": 1})
    assert rows(results.dir / "curve.csv")[0]["test_accuracy"] == "0.5"
    assert json.loads((results.dir / "config.json").read_text()) == {"a": 1}
    results.add_run_row({"model": "lr"})
    assert rows(tmp_path / "runs.csv")[0]["run"] == results.dir.name


def test_csv_log_keeps_its_header(tmp_path):
    log = CsvLog(tmp_path / "x.csv", ["a", "b"])
    log.append({"a": 1, "b": 2.123456789})
    CsvLog(tmp_path / "x.csv", ["a", "b"]).append({"a": 3})
    assert rows(tmp_path / "x.csv") == [{"a": "1", "b": "2.12346"}, {"a": "3", "b": ""}]


def every_write(writer, meanwhile) -> None:
    """Each write of :class:`~mpitrain.train.context.ResultsWriter` (the test below
    holds this list to the Protocol's), as a run makes them; TensorBoard's scalars
    only where ``writer`` is the null one (TensorFlow's import is seconds)."""
    writer.write_json("config.json", {"config": {}})
    writer.add_curve_row({"epoch": 1, "step": 1, "test_loss": 0.5})
    writer.write_csv("timing.csv", ["rank", "wall_s"], [{"rank": 0, "wall_s": 1.0}])
    writer.replace_csv("staleness.csv", ["staleness", "count"], [{"staleness": 0, "count": 1}])
    writer.add_run_row({"model": "lr"})
    writer.save_checkpoint(Checkpoint(np.zeros(3, np.float32), {}, 1, 0.0), meanwhile)
    writer.set_status("running")
    writer.note_progress(3)
    writer.set_status("ok")
    if isinstance(writer, NullResults):
        writer.scalars(1, {"test/loss": 0.5})


WRITES = {"write_json", "add_curve_row", "write_csv", "replace_csv", "add_run_row",
          "save_checkpoint", "set_status", "note_progress", "scalars"}


def test_null_results_write_nothing_where_the_real_ones_write(tmp_path, monkeypatch):
    """Every write a run makes, to RunResults and to NullResults, each in a directory
    of its own that is also the working directory (where a null object that wrote
    anyway would put a file named as given): the real one's fills, the null one's
    stays empty; both run the checkpoint's ``meanwhile`` (the evaluation)."""
    protocol = {name for name in vars(ResultsWriter) if not name.startswith("_")}
    assert protocol == WRITES | {"path"}
    ran = []
    real_dir, null_dir = tmp_path / "real", tmp_path / "null"
    real_dir.mkdir()
    null_dir.mkdir()
    monkeypatch.chdir(real_dir)
    real = RunResults(real_dir, "lr-sync-np2")
    every_write(real, lambda: ran.append("real"))
    assert {"config.json", "curve.csv", "timing.csv", "staleness.csv", "checkpoint.npz",
            "status.json"} <= {p.name for p in real.dir.iterdir()}
    assert (real_dir / "runs.csv").is_file()
    monkeypatch.chdir(null_dir)
    null = NullResults()
    every_write(null, lambda: ran.append("null"))
    assert null.path is None and list(null_dir.iterdir()) == []
    assert ran == ["real", "null"]


def test_a_resumed_async_run_counts_its_staleness_once(tmp_path):
    """staleness.csv holds the whole run's counts, which a resumed run carries on from
    its checkpoint: each session's report replaces the file (it used to append, so a
    resumed run's file held its first session's histogram and then the whole run's:
    the first session's updates counted twice)."""
    import collections
    from types import SimpleNamespace

    from mpitrain.run.console import NullConsole
    from mpitrain.train.asynchronous.accounts import WorkerAccount, report

    from mpitrain.config import Config
    from mpitrain.run.checkpoint import Checkpoint, CheckpointMeta

    results = RunResults(tmp_path, "lr-async-np3")
    ctx = SimpleNamespace(results=results, console=NullConsole(), lost=[], resume_from=None,
                          cfg=Config.of(async_mode=True, world_size=3))
    share = {"server_cpu_share": 0.1, "server_loop_cpu_share": 0.05, "server_nice": 0}

    def session(counts):  # {worker: {staleness: count}}, cumulative as restored
        workers = {r: WorkerAccount(r, steps=sum(c.values()), elapsed=1.0,
                                    staleness=collections.Counter(c))
                   for r, c in counts.items()}
        report(ctx, workers, sum(w.steps for w in workers.values()), 1.0, None, share, 0)
        return [(int(r["server"]), int(r["worker"]), int(r["staleness"]), int(r["count"]))
                for r in rows(results.dir / "staleness.csv")]

    assert session({1: {0: 3, 1: 2}, 2: {1: 5}}) == [(0, 1, 0, 3), (0, 1, 1, 2), (0, 2, 1, 5)]
    # the resumed session: its counts include the first session's
    assert session({1: {0: 4, 1: 6}, 2: {1: 5, 2: 1}}) == [
        (0, 1, 0, 4), (0, 1, 1, 6), (0, 2, 1, 5), (0, 2, 2, 1)]
    assert not list(results.dir.glob("*.tmp"))
    # resumed from --servers 2 onto one server: the other server's counts, which no
    # server of this session goes on with, stay in the file (and in its checkpoints)
    saved = {1: {2: {0: 7}}}
    ctx.resume_from = Checkpoint(np.zeros(1, np.float32), {}, 0, 0.0, {},
                                 CheckpointMeta(partition_staleness=saved))
    assert session({2: {0: 9}}) == [(0, 2, 0, 9), (1, 2, 0, 7)]
    ctx.resume_from = Checkpoint(np.zeros(1, np.float32), {}, 0, 0.0, {}, CheckpointMeta(
        retired_staleness=saved))  # a checkpoint of that resumed session
    assert session({2: {0: 9}}) == [(0, 2, 0, 9), (1, 2, 0, 7)]


def test_the_progress_noted_while_running_is_throttled_and_kept_at_the_end(tmp_path,
                                                                          monkeypatch):
    """note_progress writes status.json's step only while the run says running, at most
    every PROGRESS_NOTE_EVERY seconds and without an fsync (rank 0's training thread
    writes it); the status the run ends with keeps the last one, durably (mpitrain
    launch counts a failure's lost steps by it)."""
    import json

    from mpitrain import atomic
    from mpitrain.results import run_dir

    clock = [100.0]
    monkeypatch.setattr(run_dir.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv(run_dir.ATTEMPT_ENV, "launched")  # (no witness process)
    results = RunResults(tmp_path, "lr-sync-np2")
    status = lambda: json.loads((results.dir / "status.json").read_text())  # noqa: E731
    results.note_progress(5)  # not running yet: nothing
    assert not (results.dir / "status.json").exists()
    results.set_status("running", "resumed", lost_workers=[])
    results.note_progress(10)
    assert status()["step"] == 10 and status()["reason"] == "resumed"
    clock[0] += run_dir.PROGRESS_NOTE_EVERY / 2
    results.note_progress(20)
    assert status()["step"] == 10
    clock[0] += run_dir.PROGRESS_NOTE_EVERY
    synced = []
    monkeypatch.setattr(atomic.os, "fsync", synced.append)
    results.note_progress(30)
    assert status()["step"] == 30 and status()["status"] == "running"
    assert synced == []  # (no fsync on the training thread for a note)
    results.set_status("failed", "a peer was lost")
    assert status()["step"] == 30 and status()["lost_workers"] == [] and len(synced) == 1
