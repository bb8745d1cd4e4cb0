"""One run's figures (:data:`RUN_FIGURES`): learning curves, per-node host resources,
per-rank process CPU, where each rank's time went, MPI traffic and staleness; and the
style every figure of :mod:`.plots` shares. Each builder takes a :class:`~.run_files.Run`
and returns a matplotlib Figure, or None where the run has no data for it.

Units: MB are 2**20 bytes (as in ``runs.csv``); host CPU % is the whole host
(100 = every core busy); process CPU % is of one core (above 100 with threads).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from .run_files import MB, Run, Table, results_error

DPI = 120
STYLE: Dict[str, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "figure.titlesize": 12,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.facecolor": "white",
    "savefig.facecolor": "white",
}
PHASE_COLORS = {"compute": "#4c72b0", "codec": "#8172b3", "comm": "#dd8452", "wait": "#c44e52",
                "other": "#bbbbbb"}
KIND_COLORS = {"allreduce": "C0", "pull": "C1", "push": "C2", "broadcast": "C4",
               "control": "C7"}
MODE_STYLE = {"single": ("-", "o"), "sync": ("-", "s"), "async": ("--", "^")}


# --------------------------------------------------------------------------- figures


def new_figure(title: str, nrows: int = 1, ncols: int = 1, size: Tuple[float, float] = (8, 5),
               **kwargs) -> Tuple[Figure, np.ndarray]:
    """A constrained-layout Figure (no pyplot, no display) and its axes as a flat array."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False, **kwargs)).ravel()
    fig.suptitle(title)
    return fig, axes


def save_figure(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (ResultsError if the directory is not writable)."""
    try:
        fig.savefig(path, dpi=DPI, format="png")
    except OSError as e:
        raise results_error(path, f"cannot be written ({e.strerror})",
                            "check that the directory exists and is writable") from None
    return path


def _run_title(run: Run, what: str) -> str:
    how_many = f"{run.workers} worker{'s' if run.workers != 1 else ''}"
    return f"{what}\n{run.model.upper()} {run.label()} ({how_many}) · {run.name}"


def from_zero(ax, top: Optional[float] = None) -> None:
    """Start the y axis at zero, with a sliver below it so lines at zero stay visible."""
    top = ax.get_ylim()[1] if top is None else top
    ax.set_ylim(-0.02 * top, top)


def _legend_outside(ax, **kwargs) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kwargs)


def log_loss_axis(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def no_data(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="grey")


CURVE_X = {"epoch": ("epoch", "epoch"), "time": ("wall_time_s", "wall time since start (s)")}


def has_data(ax) -> bool:
    return any(np.isfinite(np.asarray(line.get_ydata(), dtype=float)).any() for line in ax.lines)


def fig_curves(run: Run, x: str = "epoch") -> Figure:
    """Train/test loss and test accuracy of one run vs epoch (``x="epoch"``) or wall time."""
    column, xlabel = CURVE_X[x]
    what = xlabel.split(" (")[0]
    fig, (loss_ax, acc_ax) = new_figure(_run_title(run, f"Loss and accuracy vs {what}"),
                                        1, 2, size=(10, 4.5))
    xs, curve = run.curve[column], run.curve
    for name, style in (("train_loss", "--"), ("test_loss", "-")):
        ok = np.isfinite(curve[name])
        if ok.any():
            loss_ax.plot(xs[ok], curve[name][ok], style, marker="o", ms=3,
                         label=name.replace("_", " "))
    acc = curve["test_accuracy"] * 100
    if np.isfinite(acc).any():
        acc_ax.plot(xs, acc, "-", marker="o", ms=3, color="C2",
                    label=f"test accuracy (final {last_finite(acc):.2f} %)")
    loss_ax.set(title="Loss (cross-entropy, log scale)", xlabel=xlabel, ylabel="loss")
    acc_ax.set(title="Test accuracy", xlabel=xlabel, ylabel="accuracy (%)")
    for ax, loc in ((loss_ax, "upper right"), (acc_ax, "lower right")):
        if not has_data(ax):
            no_data(ax, "not recorded")
            continue
        mark_changes(ax, run, x)
        ax.legend(loc=loc)
        if x == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if has_data(loss_ax):
        log_loss_axis(loss_ax)
    return fig


#: how each change of membership.csv is marked: colour, legend label
CHANGE_MARKS = {"failure": ("C3", "restart after a failure"),
                "grow": ("C2", "restart to take hosts in"),
                "worker lost": ("C1", "async worker lost")}


def mark_changes(ax, run: Run, x: str) -> None:
    """A dotted line where the run went on after each change of its membership
    (membership.csv, written by mpitrain launch): the checkpoint's epoch (``x="epoch"``)
    or training clock it went on from."""
    changes = run.tables.get("membership")
    if changes is None or len(changes) == 0:
        return
    if x == "epoch":
        known = np.isfinite(run.curve["step"]) & np.isfinite(run.curve["epoch"])
        at = np.interp(changes["step"], run.curve["step"][known], run.curve["epoch"][known]) \
            if known.any() else np.full(len(changes), np.nan)
    else:
        at = changes["wall_time_s"]
    shown = set()
    for where, change in zip(at, changes["change"]):
        color, label = CHANGE_MARKS.get(change, ("C7", change))
        if np.isfinite(where):
            ax.axvline(where, color=color, ls=":", lw=1.2,
                       label=None if change in shown else label)
            shown.add(change)


def mark_restarts(ax, run: Run) -> None:
    """A dotted line on a telemetry plot where each later session of the run began."""
    for i, where in enumerate(run.restarts):
        ax.axvline(where, color="black", ls=":", lw=1, label=None if i else "restart")


def node_label(index: int, host: str, is_ps: bool) -> str:
    """Legend label of a node: ``node0 (PS) – host`` for the parameter server's node."""
    return f"node{index}{' (PS)' if is_ps else ''} – {host}"


def node_labels(run: Run) -> Dict[str, str]:
    """Legend label of every node of ``run`` by host; the node holding rank 0 is the PS."""
    hosts = run.rank_hosts()
    ps_host = hosts.get(0) if run.mode != "single" else None
    return {host: node_label(i, host, host == ps_host) for i, host in enumerate(run.nodes())}


def node_series(tel: Table, host: str, column: str) -> Tuple[np.ndarray, np.ndarray]:
    """Time and value of a host-level column (filled on the node's lowest rank only)."""
    rows = tel.where((tel["host"] == host) & np.isfinite(tel[column]))
    order = np.argsort(rows["time_s"], kind="stable")
    return rows["time_s"][order], rows[column][order]


def node_rates(tel: Table, host: str, column: str) -> Tuple[np.ndarray, np.ndarray]:
    """MB/s over each sampling interval of a cumulative byte counter, for a post-step plot.

    Returns the start time of every interval plus the end of the last one, and each
    interval's rate (the last repeated), so ``drawstyle="steps-post"`` draws every
    interval at its own height.
    """
    t, total = node_series(tel, host, column)
    dt, dv = np.diff(t), np.diff(total)
    ok = (dt > 1e-3) & (dv >= 0)  # a counter that went down (reset) gives no rate
    if not ok.any():
        return np.array([]), np.array([])
    rates = dv[ok] / dt[ok] / MB
    return np.r_[t[:-1][ok], t[1:][ok][-1]], np.r_[rates, rates[-1]]


def node_memory(tel: Table, host: str) -> Tuple[np.ndarray, np.ndarray]:
    """Sum of the RSS (MB) of the node's ranks, each interpolated onto the node's sample times."""
    rows = tel.where((tel["host"] == host) & np.isfinite(tel["rss_mb"]))
    grid = np.unique(rows["time_s"])
    total = np.zeros_like(grid)
    for rank in rows.values("rank"):
        mine = rows.where(rows["rank"] == rank)
        order = np.argsort(mine["time_s"], kind="stable")
        total += np.interp(grid, mine["time_s"][order], mine["rss_mb"][order])
    return grid, total


def fig_nodes(run: Run) -> Optional[Figure]:
    """Per-node host CPU %, memory (sum of the node's ranks) and network rx/tx rate over time."""
    tel = run.tables.get("telemetry")
    if tel is None or len(tel) == 0:
        return None
    fig, (cpu_ax, mem_ax, net_ax) = new_figure(_run_title(run, "Resources per node over time"),
                                               3, 1, size=(9, 8.5), sharex=True)
    for i, (host, label) in enumerate(node_labels(run).items()):
        color = f"C{i % 10}"
        t, cpu = node_series(tel, host, "host_cpu_percent")
        cpu_ax.plot(t, cpu, color=color, marker=".", drawstyle="steps-pre", label=label)
        t, mem = node_memory(tel, host)
        mem_ax.plot(t, mem, color=color, label=label)
        for column, style, kind in (("net_rx_bytes", "-", "rx"), ("net_tx_bytes", "--", "tx")):
            t, rate = node_rates(tel, host, column)
            net_ax.plot(t, rate, style, color=color, drawstyle="steps-post",
                        label=f"{label} {kind}")
    cpu_ax.set(title="Host CPU (100 % = all cores busy)", ylabel="CPU (%)", ylim=(0, 105))
    mem_ax.set(title="Memory: RSS summed over the node's ranks", ylabel="RSS (MB)")
    net_ax.set(title="Network, all interfaces but loopback (MPI inside a node does not show)",
               ylabel="rate (MB/s)", xlabel="time since start (s)")
    from_zero(mem_ax)
    from_zero(net_ax)
    for ax, what in ((cpu_ax, "host CPU"), (mem_ax, "memory"), (net_ax, "network")):
        mark_restarts(ax, run)
        if has_data(ax):
            _legend_outside(ax)
        else:
            no_data(ax, f"{what} not recorded")
    return fig


def _rank_label(run: Run, rank: int) -> str:
    return f"rank {rank} ({run.role(rank)})"


def fig_rank_cpu(run: Run) -> Optional[Figure]:
    """Process CPU % (of one core) of every rank over time."""
    tel = run.tables.get("telemetry")
    if tel is None or len(tel) == 0:
        return None
    fig, (ax,) = new_figure(_run_title(run, "Process CPU per rank"), size=(9, 5))
    for rank in sorted(tel.values("rank")):
        mine = tel.where((tel["rank"] == rank) & np.isfinite(tel["cpu_percent"]))
        order = np.argsort(mine["time_s"], kind="stable")
        ax.plot(mine["time_s"][order], mine["cpu_percent"][order], marker=".",
                drawstyle="steps-pre", label=_rank_label(run, int(rank)))
    ax.set(xlabel="time since start (s)", ylabel="process CPU (% of one core)")
    ax.set_ylim(bottom=0)
    mark_restarts(ax, run)
    _legend_outside(ax)
    return fig


PHASES = ("compute", "codec", "comm", "wait", "other")


def phase_totals(timing: Table) -> Dict[str, np.ndarray]:
    """Seconds per phase (compute, codec: a compression's computing, comm, wait, other =
    wall minus the rest) for each row; runs written before codec_s have none."""
    codec = np.nan_to_num(timing["codec_s"])
    known = timing["compute_s"] + codec + timing["comm_s"] + timing["wait_s"]
    return {"compute": timing["compute_s"], "codec": codec, "comm": timing["comm_s"],
            "wait": timing["wait_s"], "other": np.clip(timing["wall_s"] - known, 0, None)}


def _stacked_bars(ax, positions, parts: Dict[str, np.ndarray], width: float,
                  legend: bool) -> float:
    """Stack the phases as bars; returns the tallest total (for the y limits)."""
    bottom = np.zeros(len(positions))
    for phase in PHASES:
        ax.bar(positions, parts[phase], width, bottom=bottom, color=PHASE_COLORS[phase],
               label=phase if legend else None)
        bottom = bottom + parts[phase]
    return float(bottom.max()) if len(bottom) else 0.0


def fig_time_breakdown(run: Run) -> Optional[Figure]:
    """Compute / comm / wait / other seconds per rank, summed over all epochs."""
    timing = run.tables.get("timing")
    if timing is None or len(timing) == 0:
        return None
    ranks = sorted(int(r) for r in timing.values("rank"))
    per_row = phase_totals(timing)
    parts = {p: np.array([per_row[p][timing["rank"] == r].sum() for r in ranks]) for p in PHASES}
    fig, (ax,) = new_figure(_run_title(run, "Where each rank's time went (all epochs)"),
                            size=(8, 5))
    _stacked_bars(ax, np.arange(len(ranks)), parts, 0.6, legend=True)
    totals = np.sum(list(parts.values()), axis=0)
    for i, total in enumerate(totals):
        ax.annotate(f"{total:.2f} s", (i, total), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=9)
    ax.set_xticks(np.arange(len(ranks)), [_rank_label(run, r).replace(" (", "\n(") for r in ranks])
    ax.set(ylabel="seconds (sum over epochs)")
    ax.set_ylim(top=max(totals.max(), 1e-9) * 1.12)
    ax.grid(axis="x", visible=False)
    _legend_outside(ax, title="phase")
    return fig


def fig_time_per_epoch(run: Run) -> Optional[Figure]:
    """Compute / comm / wait / other seconds per epoch, one panel per rank."""
    timing = run.tables.get("timing")
    if timing is None or len(timing) == 0:
        return None
    ranks = sorted(int(r) for r in timing.values("rank"))
    ncols = 1 if len(ranks) == 1 else 2
    nrows = math.ceil(len(ranks) / ncols)
    fig, axes = new_figure(_run_title(run, "Time per epoch and rank"), nrows, ncols,
                           size=(10, 1.2 + 2.6 * nrows), sharex=True, sharey=True)
    tallest = 0.0
    for ax, rank in zip(axes, ranks):
        mine = timing.where(timing["rank"] == rank)
        tallest = max(tallest, _stacked_bars(ax, mine["epoch"], phase_totals(mine), 0.7,
                                             legend=ax is axes[0]))
        ax.set_title(_rank_label(run, rank))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="x", visible=False)
    # explicit limits: zero-height bars stacked on top would otherwise pin the axis top
    axes[0].set_ylim(0, max(tallest, 1e-9) * 1.05)
    for ax in axes[len(ranks):]:
        ax.set_visible(False)
    for ax in axes[-ncols:]:
        ax.set_xlabel("epoch")
    for ax in axes[::ncols]:
        ax.set_ylabel("seconds")
    fig.legend(loc="outside lower center", ncols=len(PHASES), title=None)
    return fig


def fig_comm(run: Run) -> Optional[Figure]:
    """MPI payload sent and received by every rank, stacked by message kind."""
    comm = run.tables.get("comm")
    if comm is None or len(comm) == 0:
        return None
    ranks = sorted(int(r) for r in comm.values("rank"))
    kinds = sorted(comm.values("kind"))
    fig, axes = new_figure(_run_title(run, "MPI traffic per rank (payload bytes)"), 1, 2,
                           size=(10, 4.8), sharey=True)
    tallest = 0.0
    for ax, column, title in zip(axes, ("sent_bytes", "recv_bytes"), ("sent", "received")):
        bottom = np.zeros(len(ranks))
        for i, kind in enumerate(kinds):
            mine = comm.where(comm["kind"] == kind)
            mb = np.array([mine[column][mine["rank"] == r].sum() / MB for r in ranks])
            ax.bar(np.arange(len(ranks)), mb, 0.6, bottom=bottom,
                   color=KIND_COLORS.get(kind, f"C{(i + 5) % 10}"),
                   label=kind if ax is axes[0] else None)
            bottom = bottom + mb
        tallest = max(tallest, float(bottom.max()))
        ax.set_xticks(np.arange(len(ranks)), [_rank_label(run, r).replace(" (", "\n(")
                                              for r in ranks])
        ax.set(title=title, ylabel="MB" if ax is axes[0] else None)
        ax.grid(axis="x", visible=False)
    axes[0].set_ylim(0, max(tallest, 1e-9) * 1.08)
    fig.legend(loc="outside right upper", title="kind")
    return fig


def staleness_cutoff(stale: Table, share: float = 0.99) -> int:
    """Staleness below which ``share`` of all updates fall (bounded to 5..20), for the bins."""
    order = np.argsort(stale["staleness"])
    values, counts = stale["staleness"][order], stale["count"][order]
    cum = np.cumsum(counts) / max(counts.sum(), 1)
    at = min(int(np.searchsorted(cum, share)), len(values) - 1)
    cutoff = values[at] if len(values) else 0
    return int(min(max(cutoff, 5), 20, max(values.max() if len(values) else 0, 5)))


def fig_staleness(run: Run) -> Optional[Figure]:
    """Histogram of gradient staleness per worker (async), as a share of its updates."""
    stale = run.tables.get("staleness")
    if stale is None or len(stale) == 0 or stale["count"].sum() <= 0:
        return None
    worker_ranks = sorted(int(w) for w in stale.values("worker"))
    cutoff = staleness_cutoff(stale)
    bins = np.arange(cutoff + 2)  # 0..cutoff, then one bin for everything above
    width = 0.8 / len(worker_ranks)
    fig, (ax,) = new_figure(_run_title(run, "Staleness of applied gradients per worker"),
                            size=(9, 5))
    for i, worker in enumerate(worker_ranks):
        mine = stale.where(stale["worker"] == worker)
        n = mine["count"].sum()
        share = np.array([mine["count"][mine["staleness"] == s].sum() for s in bins[:-1]]
                         + [mine["count"][mine["staleness"] > cutoff].sum()]) / n * 100
        mean = (mine["staleness"] * mine["count"]).sum() / n
        ax.bar(bins + (i - (len(worker_ranks) - 1) / 2) * width, share, width,
               label=f"worker {worker}: n={n:.0f}, mean {mean:.1f}, "
                     f"max {mine['staleness'].max():.0f}")
    bound = run.staleness_bound
    if bound is not None and bound <= cutoff:
        ax.axvline(bound + 0.5, color="black", ls=":", label=f"bound K={bound}")
    every = 1 if cutoff <= 12 else 2  # keep the tick labels apart
    ax.set_xticks(bins, [str(b) if b % every == 0 or b == cutoff else "" for b in bins[:-1]]
                  + [f">{cutoff}"])
    ax.set(xlabel="staleness (server updates between pull and apply)",
           ylabel="share of the worker's gradients (%)")
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper right")
    return fig


def last_finite(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if len(finite) else math.nan


RUN_FIGURES: Tuple[Tuple[str, str, Callable[[Run], Optional[Figure]]], ...] = (
    ("fig-curves-epoch.png", "Loss and test accuracy vs epoch", lambda r: fig_curves(r, "epoch")),
    ("fig-curves-time.png", "Loss and test accuracy vs wall time", lambda r: fig_curves(r, "time")),
    ("fig-nodes.png", "Host CPU, memory and network per node", fig_nodes),
    ("fig-rank-cpu.png", "Process CPU per rank", fig_rank_cpu),
    ("fig-time-breakdown.png", "Compute / comm / wait per rank", fig_time_breakdown),
    ("fig-time-per-epoch.png", "Compute / comm / wait per epoch", fig_time_per_epoch),
    ("fig-comm.png", "MPI traffic per rank", fig_comm),
    ("fig-staleness.png", "Staleness histogram per worker", fig_staleness),
)
