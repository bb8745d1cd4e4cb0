"""Stopping, saving and resuming a run.

* :class:`StopRequest` — SIGTERM, SIGINT and SIGUSR1 set a flag that the
  training loops read every step; the protocols make all ranks agree on the
  step at which they stop, rank 0 saves a checkpoint and the results so far,
  and the job exits with code 143 (interrupted). SIGTERM is what SLURM sends
  at the time limit and on ``scancel``; mpirun forwards SIGTERM/SIGINT to the
  ranks but SIGKILLs them about a second later, while it forwards SIGUSR1 and
  then waits, so ``kill -USR1 <mpirun pid>`` is the way to stop a large model
  gracefully (the SLURM scripts in jobs/ do that).
* :class:`Checkpoint` — the canonical weights, the optimizer state and the
  training position, written by rank 0 to ``checkpoint.npz`` in the run
  directory atomically (temporary file, then rename).
* :func:`resumed_config` — the configuration of a run being resumed with
  ``--resume RUN_DIR``: the saved one, with only the settings that may change
  between sessions taken from the command line.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from .atomic import atomic_file
from .config import Config
from .errors import ResultsError, UsageError
from .models import same_model

CHECKPOINT = "checkpoint.npz"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

#: settings a resumed run may change; every other one must match the saved run
RESUMABLE_CHANGES = ("epochs", "eval_every", "checkpoint_every", "checkpoint_steps",
                     "quiet", "timeout",
                     "liveness_floor",
                     "sample_interval", "threads", "keep_cpu_binding", "data_dir", "resume",
                     "steps", "dry_run")


class StopRequest:
    """Set by a stop signal; read by the training loops (cheap: one attribute).

    A second signal of the same kind restores the default action, so a user
    pressing Ctrl-C twice is not held hostage by a slow save.
    """

    def __init__(self):
        self.signum: Optional[int] = None

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
        self.signum = signum

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop from code (a peer told us, or a test)."""
        if self.signum is None:
            self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@dataclass
class Checkpoint:
    """Everything needed to continue a run where it stopped."""

    weights: np.ndarray  # flat float32, the model's fixed variable order
    optimizer: Dict[str, np.ndarray]  # optimizer state, by name
    step: int  # sync: steps each worker has done; async: server version
    wall_time_s: float  # training time before this checkpoint (the clock continues)
    worker_steps: Dict[int, int] = field(default_factory=dict)  # async: steps per worker rank
    extra: Dict[str, object] = field(default_factory=dict)  # e.g. async staleness counts
    #: the model's float non-trainable state (BatchNorm statistics), flat; empty for most
    buffers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    @property
    def state(self) -> np.ndarray:
        """Weights then buffers, as :meth:`mpitrain.replica.Replica.state` orders them."""
        return np.concatenate([self.weights, self.buffers]) if self.buffers.size \
            else self.weights

    def save(self, run_dir: Path) -> Path:
        """Write ``checkpoint.npz`` atomically; the previous checkpoint stays until replaced."""
        path = Path(run_dir) / CHECKPOINT
        meta = {"step": self.step, "wall_time_s": self.wall_time_s,
                "worker_steps": {str(k): v for k, v in self.worker_steps.items()},
                "extra": self.extra, "optimizer_keys": sorted(self.optimizer)}
        arrays = {f"opt_{k}": np.asarray(v) for k, v in self.optimizer.items()}
        with atomic_file(path, "wb") as f:
            np.savez(f, weights=self.weights, buffers=self.buffers, meta=np.frombuffer(
                json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "Checkpoint":
        path = Path(run_dir) / CHECKPOINT
        try:
            with np.load(path, allow_pickle=False) as f:
                meta = json.loads(f["meta"].tobytes().decode())
                optimizer = {k: f[f"opt_{k}"] for k in meta["optimizer_keys"]}
                weights = f["weights"]
                buffers = f["buffers"] if "buffers" in f.files else np.zeros(0, np.float32)
        except FileNotFoundError:
            raise ResultsError(f"{path}: no checkpoint in this run directory (it stopped "
                               "before its first checkpoint); start a new run") from None
        except Exception as e:  # zip errors, missing keys, bad JSON
            raise ResultsError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") \
                from None
        return cls(weights, optimizer, int(meta["step"]), float(meta["wall_time_s"]),
                   {int(k): int(v) for k, v in meta["worker_steps"].items()},
                   dict(meta.get("extra", {})), buffers)


def saved_config(run_dir: Path) -> dict:
    """The ``config`` section of a run's config.json."""
    path = Path(run_dir) / "config.json"
    try:
        return json.loads(path.read_text())["config"]
    except FileNotFoundError:
        raise UsageError(f"--resume {run_dir}: not a run directory (no config.json)") from None
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--resume {run_dir}: cannot read {path} ({e})") from None


def resumed_config(cli: Config, explicit: set, world_size: int) -> Config:
    """The configuration to resume ``cli.resume`` with.

    Settings given explicitly on the command line must equal the saved run's,
    except those in RESUMABLE_CHANGES (more epochs, another timeout...); the
    world size must match, since data shards and the optimizer trajectory
    depend on it. UsageError naming the first mismatch otherwise.
    """
    saved = saved_config(Path(cli.resume))
    fields = {f.name for f in dataclasses.fields(Config)}
    base = {k: v for k, v in saved.items() if k in fields}
    if not same_model(cli.model, str(base.get("model"))):
        raise UsageError(f"--resume {cli.resume}: that run trained {base.get('model')}, "
                         f"not {cli.model}")  # a user's model: the saved absolute spec loads
    if base.get("world_size") != world_size:
        raise UsageError(f"--resume {cli.resume}: that run had {base.get('world_size')} "
                         f"ranks; resume it with mpirun -np {base.get('world_size')}")
    for name in sorted(explicit):
        if name in RESUMABLE_CHANGES or name == "model":
            continue
        if getattr(cli, name) != base.get(name):
            flag = "--" + name.replace("_", "-").replace("async-mode", "async")
            raise UsageError(f"--resume {cli.resume}: {flag} was {base.get(name)!r} in that "
                             f"run, not {getattr(cli, name)!r}; resume with the same setting")
    changes = {name: getattr(cli, name) for name in RESUMABLE_CHANGES if name in explicit}
    changes["resume"] = cli.resume
    return dataclasses.replace(Config(**base), **changes)
