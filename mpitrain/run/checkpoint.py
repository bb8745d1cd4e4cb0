"""The checkpoint: :class:`Checkpoint`, the canonical weights, the optimizer state and
the training position, written by rank 0 to ``checkpoint.npz`` in the run directory
atomically (temporary file, then rename); :class:`CheckpointMeta`, what the training
protocols record in it beside the weights; :func:`geometry`, the units of its position.
"""

from __future__ import annotations

import json
import os
import threading
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, cast

import numpy as np

from ..atomic import atomic_file
from ..config import Config
from ..errors import ResultsError, UsageError
from ..userfiles import open_regular

CHECKPOINT = "checkpoint.npz"

#: one worker's staleness histogram: staleness -> updates applied at it
Histogram = Dict[int, int]
#: each worker's histogram, by worker rank
Histograms = Dict[int, Histogram]


@dataclass(frozen=True)
class Geometry:
    """The units of a checkpoint's position (:func:`geometry` of the session that wrote
    it): ranks, parameter servers and per-worker batch."""

    world_size: int
    batch_size: int  # per worker
    servers: int  # parameter servers (async ``--servers``; 1 otherwise)


@dataclass(frozen=True)
class CheckpointMeta:
    """What the training protocols record in a checkpoint beside the weights, the
    optimizer state and the position, typed: one of these per checkpoint, built by the
    constructor of the protocol that writes it (:meth:`sync`, :meth:`asynchronous`,
    :meth:`with_partition_staleness`) and read back by :meth:`from_json`, the one place
    that says what a key missing from an older checkpoint means. A field a protocol
    does not fill keeps its empty default; :func:`mpitrain.run.resume.remap_position`
    moves the per-rank ones to another session's ranks. On disk it is the JSON object ``extra`` of
    the checkpoint's metadata, with the layout older mpitrain wrote and read (rank keys
    as strings), so a checkpoint of either resumes under the other."""

    #: the units of the position (every protocol writes this session's); read by
    #: :func:`mpitrain.run.resume.remap_position` and the async server (whether saved
    #: per-server counts are this session's servers'). None: a checkpoint written
    #: before it was recorded, in the units of the run's first session
    geometry: Optional[Geometry] = None
    #: sync: each training rank's random generator state (rank -> row), written by the
    #: sync protocol's checkpointing rank (:mod:`mpitrain.train.sync_server`, or the
    #: single rank), read on resume by :mod:`mpitrain.train.sync` (rank 0 sends each
    #: rank its row); empty for a model without generators
    rng: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    #: async: each worker's staleness histogram of the updates rank 0's server applied,
    #: written and restored by :mod:`mpitrain.train.asynchronous.accounts` (a resumed
    #: run goes on counting)
    staleness: Histograms = field(default_factory=dict)
    #: async, ``--servers K``: the other servers' histograms (server rank ->), gathered
    #: by :func:`mpitrain.train.asynchronous.sharded.peers.completed`; read back by
    #: the async server (the same servers) or as :attr:`retired_staleness` (fewer)
    partition_staleness: Dict[int, Histograms] = field(default_factory=dict)
    #: async: the histograms of servers an earlier session had and this one has not
    #: (server rank ->), carried from checkpoint to checkpoint by
    #: :mod:`mpitrain.train.asynchronous.accounts` so staleness.csv counts them
    retired_staleness: Dict[int, Histograms] = field(default_factory=dict)
    #: async: steps each worker makes beyond the run's steps per worker (a lost
    #: worker's, given to it), by worker rank; written and restored by
    #: :mod:`mpitrain.train.asynchronous.accounts`
    extra_steps: Dict[int, int] = field(default_factory=dict)
    #: async: steps lost workers left with nobody to take them (the run was stopping);
    #: the workers of the resumed run share them (accounts)
    updates_short: int = 0
    #: async: the workers the run lost, as ``Context.lost`` holds them (``rank``,
    #: ``host``, ``update``, ``reason``); restored so runs.csv names them all (accounts)
    lost_workers: Tuple[Dict[str, Any], ...] = ()

    @classmethod
    def sync(cls, geometry: Geometry, rng: Mapping[int, Sequence[int]]) -> "CheckpointMeta":
        """A sync checkpoint's (the single rank's and the sync server's): its geometry and
        each training rank's generator state (rank -> row; empty without generators)."""
        return cls(geometry=geometry, rng=_rows(rng))

    @classmethod
    def asynchronous(cls, geometry: Geometry, staleness: Mapping[int, Mapping[int, int]],
                     retired_staleness: Mapping[int, Histograms],
                     extra_steps: Mapping[int, int], updates_short: int,
                     lost_workers: Sequence[Dict[str, Any]]) -> "CheckpointMeta":
        """An async checkpoint's (rank 0's server): its geometry, the staleness counts of
        its own updates and of servers gone, the steps moved between workers and those
        short, the workers lost. ``--servers K`` adds the others' counts
        (:meth:`with_partition_staleness`)."""
        return cls(geometry=geometry, staleness=_histograms(staleness),
                   retired_staleness=_by_server(retired_staleness),
                   extra_steps=_counts(extra_steps),
                   updates_short=int(updates_short),
                   lost_workers=tuple(dict(w) for w in lost_workers))

    def with_partition_staleness(self, by_server: Mapping[int, Histograms]) -> "CheckpointMeta":
        """This (rank 0's async record) with the other servers' histograms (``--servers
        K``: server rank -> its histograms)."""
        return dataclasses.replace(self, partition_staleness=_by_server(by_server))

    def to_json(self) -> Dict[str, Any]:
        """The JSON object written as the checkpoint's ``extra``; no ``geometry`` key when
        there is none (older mpitrain reads a missing one, not a null)."""
        out: Dict[str, Any] = {} if self.geometry is None else {
            "geometry": dataclasses.asdict(self.geometry)}
        out.update({
            "rng": {str(r): list(row) for r, row in self.rng.items()},
            "staleness": _json_histograms(self.staleness),
            "partition_staleness": {str(s): _json_histograms(h)
                                    for s, h in self.partition_staleness.items()},
            "retired_staleness": {str(s): _json_histograms(h)
                                  for s, h in self.retired_staleness.items()},
            "extra_steps": {str(r): n for r, n in self.extra_steps.items()},
            "updates_short": self.updates_short,
            "lost_workers": [dict(w) for w in self.lost_workers]})
        return out

    @classmethod
    def from_json(cls, extra: Optional[Mapping[str, Any]]) -> "CheckpointMeta":
        """The record :meth:`to_json` wrote, or older mpitrain did (``extra`` None: a
        checkpoint without one). A key missing means what such a checkpoint's run had:
        no geometry (the run's first session's units), no ``servers`` in it (one
        server), nothing counted, moved or lost, no generator state. Raises on a
        malformed value (the caller reports the checkpoint unreadable)."""
        extra = extra or {}
        where = extra.get("geometry")
        return cls(
            geometry=None if not where else Geometry(
                int(where["world_size"]), int(where["batch_size"]),
                int(where.get("servers", 1))),
            rng=_rows(extra.get("rng") or {}),
            staleness=_histograms(extra.get("staleness") or {}),
            partition_staleness=_by_server(extra.get("partition_staleness") or {}),
            retired_staleness=_by_server(extra.get("retired_staleness") or {}),
            extra_steps=_counts(extra.get("extra_steps") or {}),
            updates_short=int(extra.get("updates_short") or 0),
            lost_workers=tuple(dict(w) for w in extra.get("lost_workers") or ()))


def _rows(rng: Mapping[Any, Sequence[int]]) -> Dict[int, Tuple[int, ...]]:
    """Generator states by rank, keys int or as JSON has them."""
    return {int(r): tuple(int(x) for x in row) for r, row in rng.items()}


def _counts(by_rank: Mapping[Any, Any]) -> Dict[int, int]:
    return {int(r): int(n) for r, n in by_rank.items()}


def _histograms(by_rank: Mapping[Any, Mapping[Any, Any]]) -> Histograms:
    """``by_rank`` (rank -> {staleness: count}, keys int or as JSON has them) with int keys
    and counts."""
    return {int(r): {int(s): int(c) for s, c in counts.items()} for r, counts in by_rank.items()}


def _by_server(by_server: Mapping[Any, Mapping[Any, Mapping[Any, Any]]]
               ) -> Dict[int, Histograms]:
    return {int(s): _histograms(h) for s, h in by_server.items()}


def _json_histograms(by_rank: Histograms) -> Dict[str, Dict[str, int]]:
    return {str(r): {str(s): c for s, c in counts.items()} for r, counts in by_rank.items()}


@dataclass
class Checkpoint:
    """Everything needed to continue a run where it stopped."""

    weights: np.ndarray  # flat float32, the model's fixed variable order
    optimizer: Dict[str, np.ndarray]  # optimizer state, by name
    step: int  # sync: steps each worker has done; async: server version
    wall_time_s: float  # training time before this checkpoint (the clock continues)
    worker_steps: Dict[int, int] = field(default_factory=dict)  # async: steps per worker rank
    #: what the protocol that wrote it records beside (rng rows, staleness counts...)
    meta: CheckpointMeta = field(default_factory=CheckpointMeta)
    #: the model's float non-trainable state (BatchNorm statistics), flat; empty for most
    buffers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    #: sync with --compression: each worker's codec state (its residuals; PowerSGD's
    #: warm start too), by worker rank (:mod:`mpitrain.exchange`); empty otherwise
    codecs: Dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def state(self) -> np.ndarray:
        """Weights then buffers, as :meth:`mpitrain.models.replica.Replica.state` orders them."""
        return np.concatenate([self.weights, self.buffers]) if self.buffers.size \
            else self.weights

    def save(self, run_dir: Path, meanwhile: Optional[Callable[[], None]] = None) -> Path:
        """Write ``checkpoint.npz`` atomically; the previous checkpoint stays until replaced.

        ``meanwhile`` (the same step's evaluation) runs on this thread while a second
        one writes the file, and the new file replaces the old one only after it
        returned: a run killed before then resumes from the previous checkpoint, all of
        whose curve rows are written, as when the two ran one after the other. A large
        model's file takes most of a second to write and sync, which the evaluation then
        hides (docs/architecture.md, "The checkpoint written beside the evaluation"). If
        ``meanwhile`` raises, the new file is dropped and the error goes on."""
        path = Path(run_dir) / CHECKPOINT
        header = {"step": self.step, "wall_time_s": self.wall_time_s,
                  "worker_steps": {str(k): v for k, v in self.worker_steps.items()},
                  "extra": self.meta.to_json(), "optimizer_keys": sorted(self.optimizer),
                  "codec_ranks": sorted(self.codecs)}
        arrays: Dict[str, Any] = {f"opt_{k}": np.asarray(v) for k, v in self.optimizer.items()}
        arrays.update({f"codec_{rank}": state for rank, state in self.codecs.items()})
        with atomic_file(path, "wb") as f:
            def write() -> None:
                np.savez(f, weights=self.weights, buffers=self.buffers, meta=np.frombuffer(
                    json.dumps(header).encode(), dtype=np.uint8), **arrays)
                f.flush()
                os.fsync(f.fileno())  # here, not after meanwhile (atomic_file's is then quick)
            if meanwhile is None:
                write()
            else:
                _alongside(write, meanwhile)
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "Checkpoint":
        path = Path(run_dir) / CHECKPOINT
        try:
            with open_regular(path, ResultsError) as file, \
                    np.load(file, allow_pickle=False) as f:
                header = json.loads(f["meta"].tobytes().decode())
                optimizer = {k: f[f"opt_{k}"] for k in header["optimizer_keys"]}
                weights = f["weights"]
                buffers = f["buffers"] if "buffers" in f.files else np.zeros(0, np.float32)
                step, wall_time_s = int(header["step"]), float(header["wall_time_s"])
                worker_steps = {int(k): int(v) for k, v in header["worker_steps"].items()}
                meta = CheckpointMeta.from_json(header.get("extra"))
                codecs = {int(r): f[f"codec_{int(r)}"] for r in header.get("codec_ranks", ())}
        except FileNotFoundError:
            raise ResultsError(f"{path}: no checkpoint in this run directory (it stopped "
                               "before its first checkpoint); start a new run") from None
        except ResultsError:
            raise
        except Exception as e:  # zip errors, missing keys, bad JSON, malformed values
            raise ResultsError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") \
                from None
        return cls(weights, optimizer, step, wall_time_s, worker_steps, meta, buffers, codecs)


def saved_position(run_dir: Path) -> Optional[Tuple[int, float]]:
    """The step and the training clock (wall_time_s) of the run's checkpoint, read without
    its arrays; None if there is none or it cannot be read."""
    try:
        with open_regular(Path(run_dir) / CHECKPOINT, ResultsError) as file, \
                np.load(file, allow_pickle=False) as f:
            header = json.loads(f["meta"].tobytes().decode())
        return int(header["step"]), float(header["wall_time_s"])
    except Exception:  # missing, being replaced, damaged: Checkpoint.load says which
        return None


def optimizer_mismatch(saved: Dict[str, np.ndarray], layout: Dict[str, tuple],
                       run_dir, everywhere: bool = True) -> Optional[UsageError]:
    """The error to raise when a checkpoint's optimizer state (``saved``) does not fit the
    optimizer it is resumed into (``layout``: {name: (shape, dtype)}), else None. It
    is not Keras' layout nor the flat optimizer's, which a resume converts between
    (:meth:`mpitrain.models.replica.Replica.adapt_optimizer_state`): an edited checkpoint,
    or one of another optimizer. ``everywhere``: False where one rank alone reads the
    checkpoint (see :class:`MpitrainError`)."""
    have = {name: int(np.size(value)) for name, value in saved.items()}
    want = {name: int(np.prod(shape, dtype=np.int64)) for name, (shape, _) in layout.items()}
    if have == want:
        return None
    return UsageError(f"--resume {run_dir}: its checkpoint's optimizer state ({len(have)} "
                      f"variable(s), {sum(have.values()):,} values) does not fit this run's "
                      f"optimizer ({len(want)}, {sum(want.values()):,} values): it was edited "
                      "or saved for another optimizer; resume a run of this model and "
                      "optimizer, or start a new one", everywhere=everywhere)


def geometry(cfg: Config) -> Geometry:
    """The units of a checkpoint's position: ranks, parameter servers and per-worker
    batch."""
    return Geometry(cfg.world_size, cast(int, cfg.batch_size), cfg.asynchronous.servers)


def _alongside(background: Callable[[], None], foreground: Callable[[], None]) -> None:
    """Run ``background`` on a thread of its own while ``foreground`` runs on this one;
    return when both have, raising the first error of either (``foreground``'s first)."""
    failed = []

    def run() -> None:
        try:
            background()
        except BaseException as e:  # re-raised on the calling thread below
            failed.append(e)
    thread = threading.Thread(target=run, name="mpitrain checkpoint writer", daemon=True)
    thread.start()
    try:
        foreground()
    finally:
        thread.join()  # a write either ends or fails; the file is ours alone till then
    if failed:
        raise failed[0]
