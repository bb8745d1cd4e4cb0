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
holds, column by column, is :mod:`mpitrain.results.schema` (shared with the writers).

Command line: ``mpitrain plot RUN_DIR [RUN_DIR ...] [-o OUT_DIR]``.

Its parts: :mod:`.run_files` reads and validates a run directory; :mod:`.run_figures`
builds one run's figures (and holds the style all share); this module, the comparisons
of several runs and the entry points.

Units: MB are 2**20 bytes (as in ``runs.csv``); host CPU % is the whole host
(100 = every core busy); process CPU % is of one core (above 100 with threads).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullLocator

from ..errors import ResultsError
from .run_figures import (CURVE_X, MODE_STYLE, RUN_FIGURES, STYLE, from_zero, has_data,
                          last_finite, log_loss_axis, new_figure, no_data, node_series,
                          save_figure)
from .run_files import MB, Run, load_run, results_error


# --------------------------------------------------------------------------- comparisons


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
    metrics = {"wall_time_s": last_finite(run.curve["wall_time_s"]),
               "accuracy": last_finite(run.curve["test_accuracy"]) * 100,
               "cpu": math.nan, "rss_mb": math.nan, "net_mb": math.nan,
               "mpi_mb": comm["sent_bytes"].sum() / MB if comm is not None else math.nan}
    if tel is not None and len(tel):
        cpu = [node_series(tel, h, "host_cpu_percent")[1] for h in run.nodes()]
        net = [last_finite(node_series(tel, h, c)[1]) for h in run.nodes()
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
        if has_data(ax):
            log_loss_axis(ax)
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
            from_zero(ax, 105 if name == "cpu" else None)
        if x == "batch_size":
            ax.set_xscale("log", base=2)
        ax.set_xticks(all_x, [str(v) for v in all_x])
        ax.xaxis.set_minor_locator(NullLocator())
        if not has_data(ax):
            no_data(ax, "not recorded")
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
        with matplotlib.rc_context(STYLE):  # type: ignore[arg-type]  # (rcParams' names)
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
