"""What the async server counts about each worker, and where those counts go:
checkpoints (so a resumed run goes on counting), staleness.csv and the summary."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import numpy as np

from ...run.checkpoint import Checkpoint, CheckpointMeta, Histograms
from ...results.schema import STALENESS_COLUMNS
from ..leases import Quotas
from ..priority import niceness
from .momentum import server_momentum
from .worker_states import AWAITED, DISMISSED, WorkerState, WorkerStates


@dataclass
class WorkerAccount:
    """The server's books on one worker (its transport is a :class:`.mailbox.ServerEnd`).
    Where it is in its life is its server's :class:`.worker_states.WorkerStates`
    (``life``), which the properties below read."""

    rank: int
    steps: int = 0  # the step of its latest push
    start_step: int = 0  # steps done before this session (a resumed run)
    elapsed: float = 0.0  # its wall time at its latest push
    applied: int = 0  # its gradients applied in this session
    pipelined: bool = False  # its last push said it keeps a second one in flight
    staleness: collections.Counter = field(default_factory=collections.Counter)
    buffers: Optional[np.ndarray] = None  # its BatchNorm statistics at its latest push
    life: Optional[WorkerStates] = field(default=None, repr=False, compare=False)

    @property
    def state(self) -> WorkerState:
        assert self.life is not None, "an account opened without its server's states"
        return self.life.of[self.rank]

    @property
    def done(self) -> bool:
        """Finished, parked or dropped: the server's loop no longer waits for it."""
        return self.state not in AWAITED

    @property
    def dismissed(self) -> bool:
        """It was told to stop (it may have finished since)."""
        return self.life is not None and self.life.was(self.rank, DISMISSED)


def open_accounts(ranks, life: WorkerStates) -> Dict[int, WorkerAccount]:
    """An account for each of ``ranks``, their states ``life``'s."""
    return {r: WorkerAccount(r, life=life) for r in ranks}


def restore(accounts: Dict[int, WorkerAccount], quotas: Quotas, ckpt: Checkpoint) -> List[dict]:
    """Go on counting from ``ckpt``: each worker's steps and staleness, and the steps left
    of the plan (relative to the run's steps per worker: ``--epochs`` may change on
    resume) shared by the workers there are. Returns the workers the run had lost."""
    meta = ckpt.meta
    left = meta.updates_short  # (a lost worker's steps nobody could take: the run stopped)
    for rank, w in accounts.items():
        w.start_step = w.steps = ckpt.worker_steps.get(rank, 0)
        w.staleness.update(meta.staleness.get(rank, {}))
        left += max(0, quotas.of[rank] + meta.extra_steps.get(rank, 0) - w.steps)
        quotas.of[rank] = w.steps
    # every rank of a resumed session is a live worker, one lost before too (its host
    # back): the steps left of the plan are shared by all of them, so the resumed run
    # makes the planned updates and a worker back gets its share
    quotas.share(left, accounts)
    return [dict(w) for w in meta.lost_workers]


def retired_staleness(ctx) -> Dict[int, Histograms]:
    """The staleness counts of the servers an earlier session had and this one has not
    (resumed onto fewer ``--servers``), by server: its checkpoint's, kept in every
    checkpoint after, so that staleness.csv, which each session writes whole, still
    counts every update each server applied."""
    ckpt = ctx.resume_from
    if ckpt is None:
        return {}
    servers = ctx.cfg.asynchronous.servers
    saved = {**ckpt.meta.retired_staleness, **ckpt.meta.partition_staleness}
    return {s: counts for s, counts in saved.items() if s >= servers}


def latest_buffers(accounts: Dict[int, WorkerAccount]) -> List[np.ndarray]:
    """The workers' latest BatchNorm statistics (of those that sent any)."""
    return [w.buffers for w in accounts.values() if w.buffers is not None]


def checkpoint(store, accounts: Dict[int, WorkerAccount], quotas: Quotas, total_steps: int,
               wall: float, ctx) -> Checkpoint:
    """The server's checkpoint: its ``store``'s parameters and optimizer state, and the
    counts :func:`restore` reads back."""
    meta = CheckpointMeta.asynchronous(
        ctx.geometry, staleness={w.rank: w.staleness for w in accounts.values()},
        retired_staleness=retired_staleness(ctx),
        extra_steps={r: q - total_steps for r, q in quotas.of.items()},
        updates_short=quotas.short, lost_workers=ctx.lost)
    return Checkpoint(store.weights.copy(), store.optimizer.state(), store.version, wall,
                      {w.rank: w.steps for w in accounts.values()}, meta,
                      store.average_buffers(latest_buffers(accounts)))


class CpuShare:
    """The server process's share of a core, and its protocol loop's (this thread), from
    now on."""

    def __init__(self):
        self.cpu0, self.loop0, self.t0 = time.process_time(), time.thread_time(), \
            time.perf_counter()

    def shares(self) -> Dict[str, float]:
        span = max(1e-9, time.perf_counter() - self.t0)
        return {"server_cpu_share": round((time.process_time() - self.cpu0) / span, 4),
                "server_loop_cpu_share": round((time.thread_time() - self.loop0) / span, 4),
                "server_nice": niceness()}  # (it keeps its priority: ..priority)


def report(ctx, accounts: Dict[int, WorkerAccount], version: int, wall: float,
           bound: Optional[int], cpu_share: Dict[str, float], short: int,
           others: Optional[Dict[int, dict]] = None) -> dict:
    """Write staleness.csv and print the async line; return the run's async columns of
    runs.csv."""
    rows: List[dict] = []
    all_staleness: collections.Counter[int] = collections.Counter()
    # (server -> worker -> staleness -> count: this server's counters, the others' dicts)
    by_server: Dict[int, Mapping[int, Mapping[int, int]]] = {
        0: {w.rank: w.staleness for w in accounts.values()}}
    by_server.update(retired_staleness(ctx))
    applied = {0: sum(w.applied for w in accounts.values())}
    for server, final in sorted((others or {}).items()):  # --servers K: the others' own
        by_server[server] = final["staleness"]
        applied[server] = sum(final["applied"].values())
    for server, histograms in by_server.items():
        for rank, staleness in sorted(histograms.items()):
            all_staleness.update(staleness)
            rows += [{"worker": rank, "staleness": s, "count": c, "server": server}
                     for s, c in sorted(staleness.items())]
    # the counts are the whole run's (a resumed run goes on from its checkpoint's)
    ctx.results.replace_csv("staleness.csv", list(STALENESS_COLUMNS), rows)
    total = sum(all_staleness.values())
    mean = sum(s * c for s, c in all_staleness.items()) / max(1, total)
    extra = {
        "staleness_mean": round(mean, 3),
        "staleness_max": max(all_staleness) if all_staleness else 0,
        "staleness_bound": "" if bound is None else bound,
        "pushes": sum(w.steps - w.start_step for w in accounts.values()),
        "applied": sum(w.applied for w in accounts.values()),
        "server_updates_per_s": round(version / max(1e-9, wall), 1),
        "worker_steps_per_s": round(float(np.mean(
            [w.steps / max(1e-9, w.elapsed) for w in accounts.values()])), 1),
        **cpu_share,
        "lost_workers": "; ".join(f"rank {w['rank']} on {w['host']} at update "
                                  f"{w['update']} ({w['reason']})" for w in ctx.lost),
        "updates_short": short,
        "servers": ctx.cfg.asynchronous.servers,
        # the servers' optimizer momentum, lowered by asynchrony's own (None, written
        # blank, if it has none)
        "server_momentum": server_momentum(ctx.cfg),
        # each server's updates (with --servers K, each push updates every share once)
        "applied_by_server": " ".join(f"{s}:{n}" for s, n in applied.items()),
    }
    ctx.console.info(
        f"async: {version} updates from {extra['pushes']} pushes; staleness mean "
        f"{extra['staleness_mean']}, max {extra['staleness_max']}; server "
        f"{extra['server_updates_per_s']} updates/s; server process "
        f"{100 * cpu_share['server_cpu_share']:.1f}% of a core (protocol loop "
        f"{100 * cpu_share['server_loop_cpu_share']:.1f}%, the rest evaluation)")
    return extra
