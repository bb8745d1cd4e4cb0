"""Report-ready figures from mpitrain run directories.

:func:`plot_runs` is the entry point. For one run it writes, into the run
directory, the learning curves (vs epoch and vs wall time), per-node host CPU,
memory and network over time, per-rank process CPU, where each rank's time went
(compute / comm / wait, in total and per epoch), MPI traffic per rank and, for
async runs, the staleness histogram per worker. For several runs it writes
comparison figures: the runs' curves on shared axes, and time, accuracy and
resources against the batch size and against the number of workers.

Every file this module writes is a PNG named ``fig-*.png``; nothing else in a
run directory is touched. Input is read with the ``csv`` module and validated:
a directory that is not a run, or a missing, empty, half-written or non-numeric
file raises :class:`~mpitrain.errors.ResultsError` with one line naming the file.
Optional files (``telemetry.csv`` when sampling was off, ``staleness.csv`` for
sync runs, ...) may be absent; their figures are then skipped. What each file
holds, column by column, is :mod:`mpitrain.schema` (shared with the writers).

Command line: ``mpitrain plot RUN_DIR [RUN_DIR ...] [-o OUT_DIR]``.

Units: MB are 2**20 bytes (as in ``runs.csv``); host CPU % is the whole host
(100 = every core busy); process CPU % is of one core (above 100 with threads).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from ..errors import ResultsError
from ..schema import CURVE, OPTIONAL_TABLES, Column
from ..userfiles import NotRegular, open_regular

MB = 2**20
DPI = 120
STYLE = {
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
PHASE_COLORS = {"compute": "#4c72b0", "comm": "#dd8452", "wait": "#c44e52", "other": "#bbbbbb"}
KIND_COLORS = {"allreduce": "C0", "pull": "C1", "push": "C2", "broadcast": "C4",
               "control": "C7"}
MODE_STYLE = {"single": ("-", "o"), "sync": ("-", "s"), "async": ("--", "^")}
DAMAGED = "the file is damaged or half-written; re-run the experiment or restore the file"


# --------------------------------------------------------------------------- reading


def results_error(path: Union[Path, str], problem: str, hint: str) -> ResultsError:
    """A one-line ResultsError: ``<path>: <problem>; <what to do>``."""
    return ResultsError(" ".join(f"{path}: {problem}; {hint}".split("\n")))


class Table:
    """The validated columns of one CSV file (numeric ones as float arrays)."""

    def __init__(self, path: Path, columns: Dict[str, np.ndarray], length: int):
        self.path, self.columns, self.length = path, columns, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def where(self, mask: np.ndarray) -> "Table":
        """The rows where ``mask`` is true."""
        return Table(self.path, {k: v[mask] for k, v in self.columns.items()}, int(mask.sum()))

    def values(self, name: str) -> list:
        """Distinct values of a column, in order of first appearance."""
        return list(dict.fromkeys(self.columns[name].tolist()))

    def rows(self) -> List[dict]:
        """Every row as a dict (numbers as floats, NaN for blanks)."""
        return [{k: v[i] for k, v in self.columns.items()} for i in range(self.length)]


Schema = Union[Sequence[Column], Callable[[List[str]], Sequence[Column]]]


def read_table(path: Path, schema: Schema) -> Table:
    """Read and validate a CSV file written by mpitrain.

    ``schema`` lists the expected columns (or builds them from the header). Raises
    ResultsError naming the file when it is missing, empty, not text, lacks a
    required column, has a line with the wrong number of fields (a truncated or
    half-written line), or a cell that should be a number and is not. Columns not
    in the schema are ignored; optional columns that are absent read as blank.
    """
    path = Path(path)
    text = _read_text(path)
    if not text.strip():
        raise results_error(path, "is empty", "the run stopped before writing it; re-run it")
    try:
        lines = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise results_error(path, f"is not valid CSV ({e})", DAMAGED) from None
    header = [h.strip() for h in lines[0]]
    columns = schema(header) if callable(schema) else schema
    missing = [c.name for c in columns if not c.optional and c.name not in header]
    if missing:
        raise results_error(path, f"missing column(s) {', '.join(missing)}",
                            "it was not written by this mpitrain version or is damaged")
    if not text.endswith("\n"):
        raise results_error(path, f"line {len(lines)} is incomplete (no end of line)",
                            "the file was half-written; wait for the run to finish or re-run it")
    body = [(n, row) for n, row in enumerate(lines[1:], start=2) if row]
    for n, row in body:
        if len(row) != len(header):
            raise results_error(path, f"line {n} has {len(row)} fields, the header has "
                                f"{len(header)}", DAMAGED)
    parsed = {c.name: _parse_column(path, c, header, body) for c in columns}
    return Table(path, parsed, len(body))


def _read_text(path: Path) -> str:
    try:
        with open_regular(path) as f:  # a FIFO or a device is refused, never waited on
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise results_error(path, "missing", "this directory is not a complete mpitrain run; "
                            "re-run it or pick another run") from None
    except NotRegular as e:
        raise results_error(path, f"is {e.kind}, not a regular file", "replace or remove it") \
            from None
    except UnicodeDecodeError:
        raise results_error(path, "is not UTF-8 text (binary or damaged)", DAMAGED) from None
    except OSError as e:
        raise results_error(path, f"cannot be read ({e.strerror})",
                            "check that it exists and is readable") from None


def _parse_column(path: Path, col: Column, header: List[str],
                  body: List[Tuple[int, List[str]]]) -> np.ndarray:
    if col.name not in header:
        return np.full(len(body), "" if col.text else np.nan, dtype=object if col.text else float)
    idx = header.index(col.name)
    cells = [(n, row[idx].strip()) for n, row in body]
    for n, cell in cells:
        if not cell and not col.blank_ok:
            raise results_error(path, f"line {n}: column {col.name} is empty", DAMAGED)
    if col.text:
        return np.array([cell for _, cell in cells], dtype=object)
    return np.array([_number(path, n, col.name, cell) for n, cell in cells], dtype=float)


def _number(path: Path, line: int, name: str, cell: str) -> float:
    if not cell:
        return math.nan
    try:
        value = float(cell)
    except ValueError:
        raise results_error(path, f"line {line}: column {name} is {cell!r}, not a number",
                            DAMAGED) from None
    return value if math.isfinite(value) else math.nan


def _read_json(path: Path) -> dict:
    text = _read_text(path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise results_error(path, f"is not valid JSON (line {e.lineno}: {e.msg})",
                            DAMAGED) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("config"), dict):
        raise results_error(path, "has no 'config' section",
                            "it was not written by mpitrain; pass an mpitrain run directory")
    return obj


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One run directory: its settings, curve and whichever optional tables it has."""

    path: Path
    meta: dict
    curve: Table
    tables: Dict[str, Optional[Table]]
    row: Dict[str, object] = field(default_factory=dict)  # its runs.csv row, if known

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def settings(self) -> dict:
        return self.meta.get("config", {})

    def setting(self, key: str, default=None):
        """A setting from config.json, else from the runs.csv row."""
        value = self.settings.get(key)
        if value is None or value == "":
            value = self.row.get(key)
        if isinstance(value, float) and math.isnan(value):
            value = None
        return default if value is None or value == "" else value

    @property
    def mode(self) -> str:
        return str(self.setting("mode", "?"))

    @property
    def model(self) -> str:
        return str(self.setting("model", "?"))

    @property
    def world_size(self) -> int:
        return _int(self.setting("world_size", self.setting("np", len(self.meta.get("ranks", [])))))

    @property
    def workers(self) -> int:
        return _int(self.setting("workers", 1))

    @property
    def batch_size(self) -> int:
        return _int(self.setting("batch_size", 0))

    def label(self) -> str:
        """How the run is named in legends: mode, np, batch size."""
        return f"{self.mode}, np={self.world_size}, batch={self.batch_size}"

    def rank_hosts(self) -> Dict[int, str]:
        """Host of every rank, from config.json (else from the telemetry/timing tables)."""
        ranks = self.meta.get("ranks")
        if isinstance(ranks, list) and ranks and all(isinstance(r, dict) for r in ranks):
            return {i: str(r.get("host", "?")) for i, r in enumerate(ranks)}
        hosts: Dict[int, str] = {}
        for table in (self.tables.get("telemetry"), self.tables.get("timing")):
            if table is not None:
                for rank, host in zip(table["rank"], table["host"]):
                    hosts.setdefault(int(rank), str(host) or "?")
        return dict(sorted(hosts.items()))

    def nodes(self) -> List[str]:
        """Distinct hosts in rank order: node0 holds rank 0."""
        return list(dict.fromkeys(self.rank_hosts().values()))

    def role(self, rank: int) -> str:
        """A rank's role (single, server or worker)."""
        for table in (self.tables.get("timing"), self.tables.get("telemetry")):
            if table is not None:
                roles = table["role"][table["rank"] == rank]
                if len(roles) and roles[0]:
                    return str(roles[0])
        return "single" if self.mode == "single" else ("server" if rank == 0 else "worker")


def _int(value) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0


def load_run(path: Path, row: Optional[dict] = None) -> Run:
    """Read and validate one run directory (ResultsError if it is not a usable run)."""
    path = Path(path)
    if not path.is_dir():
        raise results_error(path, "is not a directory",
                            "pass a run directory such as results/<time>-<model>-<mode>-np<N>")
    if not (path / "curve.csv").exists() and not (path / "config.json").exists():
        hint = ("it holds runs.csv, so it is a results directory: run mpitrain "
                "report on it, or pass one of its run directories"
                if (path / "runs.csv").exists() else
                "pass a directory made by one mpitrain run (it holds curve.csv and config.json)")
        raise results_error(path, "is not an mpitrain run (no curve.csv or config.json)", hint)
    meta = _read_json(path / "config.json")
    curve = read_table(path / "curve.csv", CURVE)
    if len(curve) == 0:
        raise results_error(path / "curve.csv", "has no rows",
                            "the run stopped before its first evaluation; re-run it")
    tables = {name: read_table(path / f"{name}.csv", schema)
              if (path / f"{name}.csv").exists() else None
              for name, schema in OPTIONAL_TABLES.items()}
    return Run(path, meta, curve, tables, dict(row or {}))


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
    workers = f"{run.workers} worker{'s' if run.workers != 1 else ''}"
    return f"{what}\n{run.model.upper()} {run.label()} ({workers}) · {run.name}"


def _from_zero(ax, top: Optional[float] = None) -> None:
    """Start the y axis at zero, with a sliver below it so lines at zero stay visible."""
    top = ax.get_ylim()[1] if top is None else top
    ax.set_ylim(-0.02 * top, top)


def _legend_outside(ax, **kwargs) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kwargs)


def _log_loss_axis(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def _no_data(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="grey")


CURVE_X = {"epoch": ("epoch", "epoch"), "time": ("wall_time_s", "wall time since start (s)")}


def _has_data(ax) -> bool:
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
                    label=f"test accuracy (final {_last(acc):.2f} %)")
    loss_ax.set(title="Loss (cross-entropy, log scale)", xlabel=xlabel, ylabel="loss")
    acc_ax.set(title="Test accuracy", xlabel=xlabel, ylabel="accuracy (%)")
    for ax, loc in ((loss_ax, "upper right"), (acc_ax, "lower right")):
        if not _has_data(ax):
            _no_data(ax, "not recorded")
            continue
        ax.legend(loc=loc)
        if x == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if _has_data(loss_ax):
        _log_loss_axis(loss_ax)
    return fig


def node_label(index: int, host: str, is_ps: bool) -> str:
    """Legend label of a node: ``node0 (PS) – host`` for the parameter server's node."""
    return f"node{index}{' (PS)' if is_ps else ''} – {host}"


def node_labels(run: Run) -> Dict[str, str]:
    """Legend label of every node of ``run`` by host; the node holding rank 0 is the PS."""
    hosts = run.rank_hosts()
    ps_host = hosts.get(0) if run.mode != "single" else None
    return {host: node_label(i, host, host == ps_host) for i, host in enumerate(run.nodes())}


def _node_series(tel: Table, host: str, column: str) -> Tuple[np.ndarray, np.ndarray]:
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
    t, total = _node_series(tel, host, column)
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
        t, cpu = _node_series(tel, host, "host_cpu_percent")
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
    _from_zero(mem_ax)
    _from_zero(net_ax)
    for ax, what in ((cpu_ax, "host CPU"), (mem_ax, "memory"), (net_ax, "network")):
        if _has_data(ax):
            _legend_outside(ax)
        else:
            _no_data(ax, f"{what} not recorded")
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
    _legend_outside(ax)
    return fig


PHASES = ("compute", "comm", "wait", "other")


def phase_totals(timing: Table) -> Dict[str, np.ndarray]:
    """Seconds per phase (compute, comm, wait, other = wall minus the rest) for each row."""
    known = timing["compute_s"] + timing["comm_s"] + timing["wait_s"]
    return {"compute": timing["compute_s"], "comm": timing["comm_s"], "wait": timing["wait_s"],
            "other": np.clip(timing["wall_s"] - known, 0, None)}


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
    totals = sum(parts.values())
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
    cutoff = values[min(np.searchsorted(cum, share), len(values) - 1)] if len(values) else 0
    return int(min(max(cutoff, 5), 20, max(values.max() if len(values) else 0, 5)))


def fig_staleness(run: Run) -> Optional[Figure]:
    """Histogram of gradient staleness per worker (async), as a share of its updates."""
    stale = run.tables.get("staleness")
    if stale is None or len(stale) == 0 or stale["count"].sum() <= 0:
        return None
    workers = sorted(int(w) for w in stale.values("worker"))
    cutoff = staleness_cutoff(stale)
    bins = np.arange(cutoff + 2)  # 0..cutoff, then one bin for everything above
    width = 0.8 / len(workers)
    fig, (ax,) = new_figure(_run_title(run, "Staleness of applied gradients per worker"),
                            size=(9, 5))
    for i, worker in enumerate(workers):
        mine = stale.where(stale["worker"] == worker)
        n = mine["count"].sum()
        share = np.array([mine["count"][mine["staleness"] == s].sum() for s in bins[:-1]]
                         + [mine["count"][mine["staleness"] > cutoff].sum()]) / n * 100
        mean = (mine["staleness"] * mine["count"]).sum() / n
        ax.bar(bins + (i - (len(workers) - 1) / 2) * width, share, width,
               label=f"worker {worker}: n={n:.0f}, mean {mean:.1f}, "
                     f"max {mine['staleness'].max():.0f}")
    bound = run.setting("staleness")
    if bound is not None and float(bound) <= cutoff:
        ax.axvline(float(bound) + 0.5, color="black", ls=":", label=f"bound K={bound}")
    every = 1 if cutoff <= 12 else 2  # keep the tick labels apart
    ax.set_xticks(bins, [str(b) if b % every == 0 or b == cutoff else "" for b in bins[:-1]]
                  + [f">{cutoff}"])
    ax.set(xlabel="staleness (server updates between pull and apply)",
           ylabel="share of the worker's gradients (%)")
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper right")
    return fig


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


# --------------------------------------------------------------------------- comparisons


def _last(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if len(finite) else math.nan


def _row_number(run: Run, key: str) -> float:
    value = run.row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def _row_nodes(run: Run, suffix: str) -> List[float]:
    keys = sorted(k for k in run.row if re.fullmatch(rf"node\d+_{suffix}", str(k)))
    return [v for v in (_row_number(run, k) for k in keys) if math.isfinite(v)]


def _total(values: Sequence[float]) -> float:
    return float(sum(values)) if len(values) else math.nan


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _metrics_from_files(run: Run) -> Dict[str, float]:
    tel, comm = run.tables.get("telemetry"), run.tables.get("comm")
    metrics = {"wall_time_s": _last(run.curve["wall_time_s"]),
               "accuracy": _last(run.curve["test_accuracy"]) * 100,
               "cpu": math.nan, "rss_mb": math.nan, "net_mb": math.nan,
               "mpi_mb": comm["sent_bytes"].sum() / MB if comm is not None else math.nan}
    if tel is not None and len(tel):
        cpu = [_node_series(tel, h, "host_cpu_percent")[1] for h in run.nodes()]
        net = [_last(_node_series(tel, h, c)[1]) for h in run.nodes()
               for c in ("net_rx_bytes", "net_tx_bytes")]
        metrics.update(
            cpu=_mean([c.mean() for c in cpu if len(c)]),
            rss_mb=_total([np.nanmean(tel["rss_mb"][tel["rank"] == r]) for r in tel.values("rank")
                           if np.isfinite(tel["rss_mb"][tel["rank"] == r]).any()]),
            net_mb=_total([v for v in net if math.isfinite(v)]) / MB)
    return metrics


def _metrics_from_row(run: Run) -> Dict[str, float]:
    return {"wall_time_s": _row_number(run, "wall_time_s"),
            "accuracy": _row_number(run, "test_accuracy") * 100,
            "cpu": _mean(_row_nodes(run, "cpu_avg")),
            "rss_mb": _total(_row_nodes(run, "rss_mb_avg")),
            "net_mb": _total(_row_nodes(run, "rx_mb") + _row_nodes(run, "tx_mb")),
            "mpi_mb": _row_number(run, "mpi_bytes") / MB}


def run_metrics(run: Run) -> Dict[str, float]:
    """Summary numbers of a run: from its runs.csv row when known, else from its files.

    wall_time_s, accuracy (%), cpu (host CPU %, mean over nodes), rss_mb (sum over
    nodes), net_mb (host rx + tx, all nodes) and mpi_mb (payload sent, all ranks).
    """
    from_row = _metrics_from_row(run)
    return {key: from_row[key] if math.isfinite(from_row[key]) else value
            for key, value in _metrics_from_files(run).items()}


def _unique_labels(runs: Sequence[Run]) -> List[str]:
    labels = [r.label() for r in runs]
    if len({r.model for r in runs}) > 1:
        labels = [f"{r.model.upper()} {label}" for r, label in zip(runs, labels)]
    return [f"{label} [{r.name}]" if labels.count(label) > 1 else label
            for r, label in zip(runs, labels)]


def fig_compare_curves(runs: Sequence[Run], x: str = "epoch") -> Figure:
    """Train loss, test loss and test accuracy of several runs on shared axes."""
    column, xlabel = CURVE_X[x]
    fig, axes = new_figure(f"Single vs sync vs async: learning curves vs {xlabel.split(' (')[0]}",
                           1, 3, size=(13, 5.2))
    for i, (run, label) in enumerate(zip(runs, _unique_labels(runs))):
        style, marker = MODE_STYLE.get(run.mode, ("-.", "d"))
        # the baseline: a wide pale line underneath, so runs that match it stay visible
        look = (dict(color="black", lw=3.5, alpha=0.3, zorder=1) if run.mode == "single" else
                dict(color=f"C{i % 10}", lw=1.4, zorder=2))
        xs = run.curve[column]
        for ax, name, scale in zip(axes, ("train_loss", "test_loss", "test_accuracy"), (1, 1, 100)):
            ok = np.isfinite(run.curve[name])
            ax.plot(xs[ok], run.curve[name][ok] * scale, style, marker=marker, ms=3.5,
                    label=label if ax is axes[0] else None, **look)
    for ax, title in zip(axes, ("Train loss (mean over the epoch)", "Test loss", "Test accuracy")):
        ax.set(title=title, xlabel=xlabel)
        if x == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[:2]:
        if _has_data(ax):
            _log_loss_axis(ax)
        ax.set_ylabel("loss (log scale)")
    axes[2].set_ylabel("accuracy (%)")
    fig.legend(loc="outside lower center", ncols=min(3, len(runs)))
    return fig


METRICS = (("wall_time_s", "Wall time", "seconds"),
           ("accuracy", "Final test accuracy", "accuracy (%)"),
           ("cpu", "Host CPU, mean over nodes", "CPU (%, 100 = all cores)"),
           ("rss_mb", "Memory: RSS of all ranks", "MB"),
           ("net_mb", "Host network rx + tx", "MB"),
           ("mpi_mb", "MPI payload sent, all ranks", "MB"))
SWEEPS = {"batch_size": ("batch size per worker", ("model", "mode", "world_size"),
                         lambda key: f"{key[1]}, np={key[2]}"),
          "workers": ("workers (single = 1)", ("model", "mode", "batch_size"),
                      lambda key: f"{key[1]}, batch={key[2]}")}


def sweep_groups(runs: Sequence[Run], x: str) -> Dict[tuple, List[Run]]:
    """Runs grouped by what stays fixed while ``x`` (batch_size or workers) varies.

    Keys are (model, mode, np or batch size). Only groups where ``x`` takes two or
    more values are kept, plus single-node runs as the baseline; sorted by mode.
    """
    groups: Dict[tuple, List[Run]] = {}
    for run in (r for r in runs if getattr(r, x) > 0):
        groups.setdefault(tuple(getattr(run, k) for k in SWEEPS[x][1]), []).append(run)
    swept = {key: members for key, members in groups.items()
             if len({getattr(r, x) for r in members}) > 1}
    if not swept:
        return {}
    swept.update({key: members for key, members in groups.items() if key[1] == "single"})
    order = list(MODE_STYLE)
    return dict(sorted(swept.items(), key=lambda kv: (
        kv[0][0], order.index(kv[0][1]) if kv[0][1] in order else len(order), kv[0][2])))


def fig_sweep(runs: Sequence[Run], x: str) -> Optional[Figure]:
    """Time, accuracy, CPU, memory, network and MPI traffic vs ``x`` (batch_size or workers).

    One line per group of runs sharing the other settings (model, mode, and np or
    batch size); repeated runs are averaged (every run is still drawn as a point).
    None when no group has two different values of ``x``.
    """
    xlabel, _, group_label = SWEEPS[x]
    groups = sweep_groups(runs, x)
    if not groups:
        return None
    what = "batch size" if x == "batch_size" else "number of workers"
    fig, axes = new_figure(f"Time, accuracy and resources vs {what}", 2, 3, size=(13, 7.5),
                           sharex=True)
    models = {key[0] for key in groups}
    all_x = sorted({getattr(r, x) for members in groups.values() for r in members})
    for i, (key, members) in enumerate(groups.items()):
        label = group_label(key) + (f" ({key[0]})" if len(models) > 1 else "")
        style, marker = MODE_STYLE.get(key[1], ("-.", "d"))
        xs = np.array([getattr(r, x) for r in members], dtype=float)
        metrics = [run_metrics(r) for r in members]
        for ax, (name, _, _) in zip(axes, METRICS):
            ys = np.array([m[name] for m in metrics])
            ux = np.unique(xs)
            means = np.array([np.nanmean(ys[xs == v]) if np.isfinite(ys[xs == v]).any()
                              else np.nan for v in ux])
            ax.plot(ux, means, style, marker=marker, color=f"C{i % 10}",
                    label=label if ax is axes[0] else None)
            if len(ux) < len(xs):
                ax.plot(xs, ys, marker, color=f"C{i % 10}", alpha=0.4, ms=4)
    for ax, (name, title, ylabel) in zip(axes, METRICS):
        ax.set(title=title, ylabel=ylabel)
        if name != "accuracy":
            _from_zero(ax, 105 if name == "cpu" else None)
        if x == "batch_size":
            ax.set_xscale("log", base=2)
        ax.set_xticks(all_x, [str(v) for v in all_x])
        ax.xaxis.set_minor_locator(NullLocator())
        if not _has_data(ax):
            _no_data(ax, "not recorded")
    for ax in axes[3:]:
        ax.set_xlabel(xlabel)
    fig.legend(loc="outside lower center", ncols=min(4, len(groups)))
    return fig


COMPARE_FIGURES: Tuple[Tuple[str, str, Callable[[Sequence[Run]], Optional[Figure]]], ...] = (
    ("fig-compare-curves-epoch.png", "Learning curves of all runs vs epoch",
     lambda rs: fig_compare_curves(rs, "epoch")),
    ("fig-compare-curves-time.png", "Learning curves of all runs vs wall time",
     lambda rs: fig_compare_curves(rs, "time")),
    ("fig-compare-batch-size.png", "Time, accuracy and resources vs batch size",
     lambda rs: fig_sweep(rs, "batch_size")),
    ("fig-compare-workers.png", "Time, accuracy and resources vs number of workers",
     lambda rs: fig_sweep(rs, "workers")),
)


# --------------------------------------------------------------------------- entry points


def _render(specs, subject, out_dir: Path) -> List[Tuple[Path, str]]:
    """Build every figure in ``specs`` for ``subject`` and save those that apply."""
    written = []
    for name, caption, build in specs:
        with matplotlib.rc_context(STYLE):
            fig = build(subject)
            if fig is not None:
                written.append((save_figure(fig, out_dir / name), caption))
    return written


def plot_run(run: Run, out_dir: Optional[Path] = None) -> List[Tuple[Path, str]]:
    """Write one run's figures (default: into its directory); returns (path, caption) pairs."""
    return _render(RUN_FIGURES, run, make_dir(Path(out_dir or run.path)))


def plot_comparison(runs: Sequence[Run], out_dir: Path) -> List[Tuple[Path, str]]:
    """Write the comparison figures of several runs into ``out_dir``; (path, caption) pairs."""
    return _render(COMPARE_FIGURES, list(runs), make_dir(Path(out_dir)))


def make_dir(path: Path, fresh: bool = False) -> Path:
    """Create ``path`` and its parents (ResultsError if impossible); returns it.

    With ``fresh``, an existing ``path`` raises FileExistsError (to pick another name).
    """
    try:
        path.mkdir(parents=True, exist_ok=not fresh)
    except FileExistsError:
        if fresh:
            raise
        raise results_error(path, "exists and is not a directory",
                            "pass a directory as the output") from None
    except OSError as e:
        raise results_error(path, f"cannot be created ({e.strerror})",
                            "pass a writable output directory") from None
    return path


def _comparison_dir(parent: Path) -> Path:
    """A new ``comparison-<timestamp>`` directory in ``parent``, never an existing one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1, 1000):
        candidate = parent / (f"comparison-{stamp}" if attempt == 1 else
                              f"comparison-{stamp}-{attempt}")
        try:
            return make_dir(candidate, fresh=True)
        except FileExistsError:
            continue
    raise results_error(parent, "has too many comparison directories", "pass out_dir")


def plot_runs(run_dirs: Iterable[Path], out_dir: Optional[Path] = None) -> List[Path]:
    """Plot one run, or compare several; returns the paths of the PNG files written.

    One run: its figures go into ``out_dir`` or the run directory itself. Several
    runs: comparison figures go into ``out_dir`` or a new ``comparison-<timestamp>``
    directory next to the first run. Raises ResultsError (one line, naming the file)
    for anything that is not a complete, readable run directory.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ResultsError("no run directories given; pass at least one results/<run> directory")
    runs = [load_run(d) for d in dirs]
    if len(runs) == 1:
        written = plot_run(runs[0], out_dir)
    else:
        written = plot_comparison(runs, Path(out_dir) if out_dir else
                                  _comparison_dir(dirs[0].resolve().parent))
    return [path for path, _ in written]
