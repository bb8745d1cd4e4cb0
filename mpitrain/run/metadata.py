"""What a run says about itself: its console lines, config.json's metadata (with every
rank's facts) and its runs.csv row."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

from .. import __version__
from ..comm import Comm, library_versions
from ..config import Config
from ..launch import preflight as preflight_checks
from ..models.keras_import import onednn_enabled
from ..results.run_dir import run_identity
from ..train import Summary
from ..train.asynchronous.compensation import chosen as compensation_of
from ..train.asynchronous.momentum import concurrent_workers, described_server_momentum


def describe_lr(cfg, n_params: int) -> str:
    """The learning rate as the console's run line gives it: how it was scaled and
    warmed up (sync), or how stale gradients are damped and bounded (async)."""
    lr = f"lr {cfg.effective_lr:g}"
    if cfg.lr_scale > 1:
        lr += f" ({cfg.optimizer.scaling} scaling of {cfg.optimizer.lr:g})"
    if cfg.warmup:
        lr += f", warm-up {cfg.warmup:g} epoch(s)"
    if cfg.mode == "async":
        lr += ", staleness compensation " + compensation_of(
            cfg.asynchronous.compensation, n_params, cfg.workers)
        at_once = concurrent_workers(cfg)
        if at_once < cfg.workers:
            lr += (f", staleness bound {cfg.staleness_bound} (at most {at_once} workers "
                   "compute at once)")
        lr += described_server_momentum(cfg)
    return lr


def rank_facts(threads: int, comm: Comm) -> dict:
    """What each rank reports about itself for config.json (and version checks); among
    it how a trainer waits in the workers' allreduce (``allreduce_wait``: spin or poll,
    None on a server) and the others' load that decided it (``others_busy_cores``)."""
    import numpy
    import tensorflow as tf

    worker_comm = comm.workers
    facts = {"host": platform.node(), "pid": os.getpid(), "threads": threads,
             "python": platform.python_version(), "tensorflow": tf.__version__,
             "numpy": numpy.__version__, "mpitrain": __version__,
             "onednn": onednn_enabled(),
             "allreduce_wait": None if worker_comm is None else
             "spin" if worker_comm.spinning else "poll", "others_busy_cores": comm.others_busy}
    facts.update(library_versions())
    return facts


def git_commit() -> str:
    """The source tree's commit, or '' when it is not a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def run_metadata(cfg: Config, dataset, replica, ranks, rescale=None) -> dict:
    import keras

    return {"config": cfg.to_dict(), "argv": sys.argv,
            **({"rescaled": rescale.as_dict()} if rescale else {}),
            "dataset": {"name": dataset.name, "source": dataset.source,
                        "train_size": dataset.train_size, "note": dataset.note,
                        # the examples evaluated on, of how many (--eval-examples)
                        "test_examples": None if dataset.y_test is None else len(dataset.y_test),
                        "test_split_size": dataset.test_split_size or (
                            None if dataset.y_test is None else len(dataset.y_test)),
                        "input_shape": list(dataset.input_shape),
                        "num_classes": dataset.num_classes, "classes": dataset.classes},
            "model": {"name": cfg.model, "parameters": replica.n_params},
            "versions": {**{k: ranks[0][k] for k in ("python", "tensorflow", "numpy",
                                                     "mpi4py", "mpi_library", "mpitrain")},
                         "keras": keras.__version__},
            "ranks": ranks, "git_commit": git_commit(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID", "")}


def run_row(cfg: Config, dataset, summary: Optional[Summary], status: str = "ok",
            reason: str = "", rescaled: str = "") -> dict:
    """The run's row in runs.csv (``summary`` may be None for a run that failed early);
    ``rescaled``: how this session continued the run on another number of ranks."""
    row = run_identity(cfg.to_dict(), {"name": dataset.name, "input_shape": dataset.input_shape,
                                       "num_classes": dataset.num_classes}, status, reason,
                       rescaled, preflight_checks.installed_version("horovod")
                       if cfg.sync.allreduce == "horovod" else "")
    if summary is not None:
        row.update(epochs=summary.epochs_done, steps=summary.steps,
                   wall_time_s=round(summary.wall_time_s, 3),
                   test_accuracy=summary.test_accuracy, test_loss=summary.test_loss,
                   train_loss=summary.train_loss, **summary.extra)
    return row


def summary_lines(cfg: Config, summary: Summary, path) -> list:
    return [f"done: {cfg.model} {cfg.mode} np={cfg.world_size}: "
            f"{summary.epochs_done:g} epoch(s), {summary.steps} steps in "
            f"{summary.wall_time_s:.2f} s; test accuracy {100 * summary.test_accuracy:.2f}%, "
            f"test loss {summary.test_loss:.4f}",
            f"results: {path}"]
