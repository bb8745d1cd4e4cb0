"""The checkpoint: :class:`Checkpoint`, the canonical weights, the optimizer state and
the training position, written by rank 0 to ``checkpoint.npz`` in the run directory
atomically (temporary file, then rename); :func:`geometry`, the units of its position.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, cast

import numpy as np

from ..atomic import atomic_file
from ..config import Config
from ..errors import ResultsError, UsageError
from ..userfiles import open_regular

CHECKPOINT = "checkpoint.npz"


@dataclass
class Checkpoint:
    """Everything needed to continue a run where it stopped."""

    weights: np.ndarray  # flat float32, the model's fixed variable order
    optimizer: Dict[str, np.ndarray]  # optimizer state, by name
    step: int  # sync: steps each worker has done; async: server version
    wall_time_s: float  # training time before this checkpoint (the clock continues)
    worker_steps: Dict[int, int] = field(default_factory=dict)  # async: steps per worker rank
    extra: Dict[str, Any] = field(default_factory=dict)  # e.g. async staleness counts
    #: the model's float non-trainable state (BatchNorm statistics), flat; empty for most
    buffers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

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
        meta = {"step": self.step, "wall_time_s": self.wall_time_s,
                "worker_steps": {str(k): v for k, v in self.worker_steps.items()},
                "extra": self.extra, "optimizer_keys": sorted(self.optimizer)}
        arrays: Dict[str, Any] = {f"opt_{k}": np.asarray(v) for k, v in self.optimizer.items()}
        with atomic_file(path, "wb") as f:
            def write() -> None:
                np.savez(f, weights=self.weights, buffers=self.buffers, meta=np.frombuffer(
                    json.dumps(meta).encode(), dtype=np.uint8), **arrays)
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
                meta = json.loads(f["meta"].tobytes().decode())
                optimizer = {k: f[f"opt_{k}"] for k in meta["optimizer_keys"]}
                weights = f["weights"]
                buffers = f["buffers"] if "buffers" in f.files else np.zeros(0, np.float32)
        except FileNotFoundError:
            raise ResultsError(f"{path}: no checkpoint in this run directory (it stopped "
                               "before its first checkpoint); start a new run") from None
        except ResultsError:
            raise
        except Exception as e:  # zip errors, missing keys, bad JSON
            raise ResultsError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") \
                from None
        return cls(weights, optimizer, int(meta["step"]), float(meta["wall_time_s"]),
                   {int(k): int(v) for k, v in meta["worker_steps"].items()},
                   dict(meta.get("extra", {})), buffers)


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


def geometry(cfg: Config) -> Dict[str, int]:
    """The units of a checkpoint's position: ranks, parameter servers and per-worker
    batch."""
    return {"world_size": cfg.world_size, "batch_size": cast(int, cfg.batch_size),
            "servers": cfg.asynchronous.servers}


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
