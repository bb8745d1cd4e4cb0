"""What the async server counts about each worker, and where those counts go:
checkpoints (so a resumed run goes on counting), staleness.csv and the summary."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ...lifecycle import Checkpoint
from ...schema import STALENESS_COLUMNS
from ..leases import Quotas


@dataclass
class WorkerAccount:
    """The server's books on one worker (its transport is a :class:`.mailbox.ServerEnd`)."""

    rank: int
    steps: int = 0  # the step of its latest push
    start_step: int = 0  # steps done before this session (a resumed run)
    elapsed: float = 0.0  # its wall time at its latest push
    applied: int = 0  # its gradients applied in this session
    pipelined: bool = False  # its last push said it keeps a second one in flight
    dismissed: bool = False  # told to stop; listened to until its FINAL push
    done: bool = False  # finished, or dropped: the server no longer waits for it
    lost: str = ""  # why it was dropped (under --enable-recovery); "" while it is in
    staleness: collections.Counter = field(default_factory=collections.Counter)
    buffers: Optional[np.ndarray] = None  # its BatchNorm statistics at its latest push


def open_accounts(ranks) -> Dict[int, WorkerAccount]:
    return {r: WorkerAccount(r) for r in ranks}


def restore(workers: Dict[int, WorkerAccount], quotas: Quotas, ckpt: Checkpoint) -> List[dict]:
    """Go on counting from ``ckpt``: each worker's steps and staleness, the steps of lost
    workers given to others (relative to the run's steps per worker: ``--epochs`` may
    change on resume). Returns the workers the run had lost."""
    extra = ckpt.extra.get("extra_steps", {})
    for rank, w in workers.items():
        w.start_step = w.steps = ckpt.worker_steps.get(rank, 0)
        for s, c in ckpt.extra.get("staleness", {}).get(str(rank), {}).items():
            w.staleness[int(s)] += c
        quotas.of[rank] += extra.get(str(rank), 0)
    quotas.short = ckpt.extra.get("updates_short", 0)
    return list(ckpt.extra.get("lost_workers", []))


def checkpoint_extra(workers: Dict[int, WorkerAccount], quotas: Quotas, total_steps: int,
                     lost: List[dict], geometry) -> dict:
    """The counts a checkpoint carries besides the model (:func:`restore` reads them)."""
    return {"staleness": {str(w.rank): dict(w.staleness) for w in workers.values()},
            "extra_steps": {str(r): q - total_steps for r, q in quotas.of.items()},
            "updates_short": quotas.short,
            "lost_workers": list(lost),
            "geometry": geometry}


def summary_extra(workers: Dict[int, WorkerAccount], results, version: int, wall: float,
                  bound: Optional[int], cpu_share: Dict[str, float], lost: List[dict],
                  short: int) -> dict:
    """Write staleness.csv; return the run's async columns of runs.csv."""
    rows, all_staleness = [], collections.Counter()
    for w in workers.values():
        all_staleness.update(w.staleness)
        rows += [{"worker": w.rank, "staleness": s, "count": c}
                 for s, c in sorted(w.staleness.items())]
    results.write_csv("staleness.csv", list(STALENESS_COLUMNS), rows)
    total = sum(all_staleness.values())
    mean = sum(s * c for s, c in all_staleness.items()) / max(1, total)
    return {
        "staleness_mean": round(mean, 3),
        "staleness_max": max(all_staleness) if all_staleness else 0,
        "staleness_bound": "" if bound is None else bound,
        "pushes": sum(w.steps - w.start_step for w in workers.values()),
        "applied": sum(w.applied for w in workers.values()),
        "server_updates_per_s": round(version / max(1e-9, wall), 1),
        "worker_steps_per_s": round(float(np.mean(
            [w.steps / max(1e-9, w.elapsed) for w in workers.values()])), 1),
        **cpu_share,
        "lost_workers": "; ".join(f"rank {w['rank']} on {w['host']} at update "
                                  f"{w['update']} ({w['reason']})" for w in lost),
        "updates_short": short,
    }
