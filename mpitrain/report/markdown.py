"""A markdown report of every run in a results directory, with its figures.

:func:`write_report` reads ``runs.csv`` and each run directory it lists, writes
the per-run figures into each run directory (``fig-*.png``), the comparison
figures into ``<results>/report/``, and ``<results>/report/report.md``: tables
of the runs, of resources per node and of async staleness, then every figure,
linked relatively so the ``report/`` folder can be dropped into a write-up next
to the run directories. Runs listed in ``runs.csv`` whose directory is gone, or that
did not end ok and have nothing to plot (an attempt that failed before its first
evaluation), are skipped with a warning in the report; anything else unreadable
raises ResultsError.

Command line: ``mpitrain report RESULTS_DIR``.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple
from urllib.parse import quote

import numpy as np

from ..atomic import write_text_atomic
from ..errors import ResultsError
from ..results.schema import NODE_COLUMN, runs_columns
from .plots import make_dir, plot_comparison, plot_run
from .run_files import MB, Run, load_run, read_table, results_error

def read_runs(results_dir: Path) -> List[dict]:
    """The rows of ``results_dir/runs.csv`` (one per run, first occurrence of a name wins)."""
    path = results_dir / "runs.csv"
    if not path.is_file():
        if (results_dir / "curve.csv").exists():
            raise results_error(path, "missing, so this is not a results directory",
                                "it is a run directory: plot it with mpitrain plot")
        if any((run / "status.json").is_file() for run in _subdirectories(results_dir)):
            # runs.csv gains its first row when the first run ends
            raise results_error(results_dir, "no run has finished here yet (runs.csv is "
                                "written as each run ends)", "report it once one has, or "
                                "plot a run that is training with mpitrain plot RUN_DIR")
        raise results_error(path, "missing, so this is not a results directory",
                            "pass the directory given to mpitrain as --results-dir "
                            "(default results/)")
    rows: Dict[str, dict] = {}
    for row in read_table(path, runs_columns).rows():
        rows.setdefault(str(row["run"]), row)
    return list(rows.values())


def _subdirectories(path: Path) -> List[Path]:
    try:
        return [child for child in path.iterdir() if child.is_dir()]
    except OSError:
        return []


def _load_listed_runs(results_dir: Path, rows: Sequence[dict]) -> Tuple[List[Run], List[str]]:
    """Load every listed run; a missing or unsafe directory name, or a run that did not
    end ok and cannot be read (it failed before its first evaluation), becomes a
    warning."""
    runs, warnings = [], []
    for row in rows:
        name = str(row["run"])
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            warnings.append(f"runs.csv lists a run named {name!r}, which is not a directory "
                            "name; skipped.")
        elif not (results_dir / name).is_dir():
            warnings.append(f"run `{name}` is listed in runs.csv but its directory is missing; "
                            "skipped.")
        else:
            try:
                runs.append(load_run(results_dir / name, row))
            except ResultsError as error:
                if row.get("status") == "ok":
                    raise
                # an attempt that failed early (mpitrain launch records each one)
                warnings.append(f"run `{name}` ended {row.get('status') or 'unrecorded'} "
                                f"with nothing to plot ({error}); skipped.")
    return runs, warnings


def write_report(results_dir: Path) -> Path:
    """Write every figure and ``results_dir/report/report.md``; returns the report's path.

    Per-run figures go into each run directory, comparison figures (when there are
    several runs) into ``results_dir/report/``. Raises ResultsError, one line naming
    the file, when ``runs.csv`` is missing or any listed run's files are unreadable.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise results_error(results_dir, "is not a directory",
                            "pass the directory given to mpitrain as --results-dir")
    runs, warnings = _load_listed_runs(results_dir, read_runs(results_dir))
    report_dir = make_dir(results_dir / "report")
    per_run = {run.name: plot_run(run) for run in runs}
    comparison = plot_comparison(runs, report_dir) if len(runs) > 1 else []
    path = report_dir / "report.md"
    text = render_markdown(results_dir, runs, warnings, per_run, comparison)
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise results_error(path, f"cannot be written ({e.strerror})",
                            "check that the directory is writable") from None
    return path


# --------------------------------------------------------------------------- markdown


def _num(value, digits: int = 2, scale: float = 1.0) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value * scale:,.{digits}f}"
    return "–"


def _text(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|") if text else "–"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; a header ending in a space is right-aligned."""
    align = ["---:" if h.endswith(" ") else "---" for h in headers]
    lines = ["| " + " | ".join(h.strip() for h in headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _get(run: Run, key: str):
    """A run's value from its runs.csv row, else from its config.json settings."""
    value = run.row.get(key)
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        value = run.settings.get(key)
    return value


def _dataset(run: Run) -> str:
    """Dataset name, with the training-set size when config.json records it."""
    info = run.meta.get("dataset")
    info = info if isinstance(info, dict) else {}
    name = _get(run, "dataset") or info.get("name")
    size = info.get("train_size")
    return _text(name) + (f" ({size:,} train)" if isinstance(size, int) and name else "")


def _col(key: str, digits: int, scale: float = 1.0) -> Callable[[Run], str]:
    return lambda run: _num(_get(run, key), digits, scale)


# Table columns: (header, cell). A header ending in a space is right-aligned.
Cell = Callable[[Run], str]
RUN_COLUMNS: Tuple[Tuple[str, Cell], ...] = (
    ("run", lambda r: f"`{r.name}`"),
    ("model", lambda r: _text(r.model)),
    ("mode", lambda r: _text(r.mode)),
    ("np ", lambda r: str(r.world_size)),
    ("workers ", lambda r: str(r.workers)),
    ("batch ", lambda r: str(r.batch_size)),
    ("epochs ", _col("epochs", 0)),
    ("wall time (s) ", _col("wall_time_s", 2)),
    ("test acc. (%) ", _col("test_accuracy", 2, 100)),
    ("test loss ", _col("test_loss", 4)),
    ("train loss ", _col("train_loss", 4)),
    ("dataset", _dataset),
    ("status", lambda r: _text(_get(r, "status"))),
)
ASYNC_COLUMNS: Tuple[Tuple[str, Cell], ...] = (
    ("run", lambda r: f"`{r.name}`"),
    ("workers ", lambda r: str(r.workers)),
    ("batch ", lambda r: str(r.batch_size)),
    ("staleness mean ", _col("staleness_mean", 2)),
    ("staleness max ", _col("staleness_max", 0)),
    ("bound K ", lambda r: "none" if r.staleness_bound is None else str(r.staleness_bound)),
    ("pushes ", _col("pushes", 0)),
    ("applied ", _col("applied", 0)),
    ("server updates/s ", _col("server_updates_per_s", 1)),
    ("worker steps/s ", _col("worker_steps_per_s", 1)),
    ("server CPU (%) ", _col("server_cpu_share", 1, 100)),
    ("server loop CPU (%) ", _col("server_loop_cpu_share", 1, 100)),
)
NODE_HEADERS = ("run", "node", "host", "CPU avg (%) ", "CPU max (%) ", "RSS avg (MB) ",
                "RSS max (MB) ", "rx (MB) ", "tx (MB) ", "MPI payload (MB) ")


def _node_rows(run: Run) -> List[List[str]]:
    """One table row per node of the run, from its runs.csv columns node{i}_*."""
    indices = sorted({int(m.group(1)) for m in map(NODE_COLUMN.fullmatch, map(str, run.row))
                      if m})
    ps = run.mode != "single"
    rows = []
    for i in indices:
        node = {key[len(f"node{i}_"):]: value for key, value in run.row.items()
                if str(key).startswith(f"node{i}_")}
        rows.append([f"`{run.name}`", f"node{i}{' (PS)' if ps and i == 0 else ''}",
                     _text(node.get("host")), _num(node.get("cpu_avg"), 1),
                     _num(node.get("cpu_max"), 1), _num(node.get("rss_mb_avg"), 0),
                     _num(node.get("rss_mb_max"), 0), _num(node.get("rx_mb"), 2),
                     _num(node.get("tx_mb"), 2),
                     _num(run.row.get("mpi_bytes"), 2, 1 / MB) if i == 0 else ""])
    return rows


CHANGE_HEADERS = ("run", "time", "change", "hosts out", "hosts in", "np ", "from step ",
                  "steps lost ", "downtime (s) ", "why")


def _change_rows(run: Run) -> List[List[str]]:
    """One table row per change of the run's membership (membership.csv)."""
    changes = run.tables.get("membership")
    return [[f"`{run.name}`", _text(c["time"]), _text(c["change"]), _text(c["hosts_out"]),
             _text(c["hosts_in"]), f"{_num(c['np_before'], 0)} → {_num(c['np_after'], 0)}",
             _num(c["step"], 0), _num(c["steps_lost"], 0), _num(c["downtime_s"], 1),
             _text(c["why"])] for c in (changes.rows() if changes is not None else [])]


def _change_costs(run: Run) -> str:
    """What a run's membership changes cost, in one line (empty without any)."""
    changes = run.tables.get("membership")
    if changes is None or len(changes) == 0:
        return ""
    down, lost = changes["downtime_s"], changes["steps_lost"]
    unknown = int((~np.isfinite(lost)).sum())
    return (f"`{run.name}`: {len(changes)} change(s), {np.nansum(down):,.1f} s without "
            f"training and {np.nansum(lost):,.0f} step(s) trained again"
            + (f" ({unknown} change(s) with steps lost unknown)" if unknown else ""))


def _image(report_dir: Path, path: Path, caption: str) -> str:
    link = quote(Path(os.path.relpath(path, report_dir)).as_posix())
    return f"![{caption}]({link})"


def render_markdown(results_dir: Path, runs: Sequence[Run], warnings: Sequence[str],
                    per_run: Dict[str, List[Tuple[Path, str]]],
                    comparison: Sequence[Tuple[Path, str]]) -> str:
    """The text of report.md: warnings, tables, then the figures with relative links."""
    report_dir = results_dir / "report"
    out = [f"# Training results: {results_dir.resolve().name}", "",
           f"{len(runs)} run(s) from `{results_dir}`, report written "
           f"{time.strftime('%Y-%m-%d %H:%M')} by `mpitrain report`.", ""]
    out += [f"> **Warning:** {w}" for w in warnings] + ([""] if warnings else [])
    out += ["## Runs", "", md_table([h for h, _ in RUN_COLUMNS],
                                    [[cell(r) for _, cell in RUN_COLUMNS] for r in runs]), "",
            "Test accuracy and loss are those of the final model on the test set; train loss "
            "is the mean over the last epoch. *batch* is per worker; np counts rank 0, the "
            "parameter server, which does not train (np=1 is the single-process baseline).", ""]
    node_rows = [row for r in runs for row in _node_rows(r)]
    if node_rows:
        out += ["## Resources per node", "", md_table(NODE_HEADERS, node_rows), "",
                "CPU is the whole host's (100 % = every core busy), sampled over the run. "
                "Memory is the RSS summed over the node's mpitrain ranks (max = sum of each "
                "rank's peak, an upper bound). rx/tx count every interface but loopback, so "
                "they include other processes' traffic and miss MPI traffic that stays inside "
                "a node; MPI payload is what mpitrain itself sent, all ranks. "
                "MB = 2^20 bytes.", ""]
    async_runs = [r for r in runs if r.mode == "async"]
    if async_runs:
        out += ["## Asynchronous runs: staleness and server load", "",
                md_table([h for h, _ in ASYNC_COLUMNS],
                         [[cell(r) for _, cell in ASYNC_COLUMNS] for r in async_runs]), "",
                "Staleness is the number of server updates between the version a worker "
                "pulled and the update that applied its gradient (bound K: `--staleness`). "
                "Server CPU is the server process's CPU time over the run in % of one core; "
                "the loop column is its protocol loop alone (the rest is evaluation).", ""]
    change_rows = [row for r in runs for row in _change_rows(r)]
    if change_rows:
        out += ["## Membership changes", "", md_table(CHANGE_HEADERS, change_rows), ""]
        out += [f"- {line}" for line in map(_change_costs, runs) if line] + [""]
        out += ["Each change of the hosts or ranks a job ran on, as `mpitrain launch` "
                "recorded it (membership.csv): the job went on from the checkpoint at "
                "*from step*; *steps lost* were trained since that checkpoint and trained "
                "again (a failure's count is a lower bound: rank 0 notes its step every few "
                "seconds; a stop to take hosts in checkpoints where it stops); *downtime* "
                "runs from the change to the job running again (its start-up included).", ""]
    if comparison:
        out += ["## Comparisons", ""]
        out += [line for path, caption in comparison
                for line in (f"### {caption}", "", _image(report_dir, path, caption), "")]
    if runs:
        out += ["## Figures per run", ""]
    for run in runs:
        out += [f"### `{run.name}`: {run.label()}", ""]
        out += [line for path, caption in per_run.get(run.name, [])
                for line in (_image(report_dir, path, caption), "")]
    return "\n".join(out).rstrip() + "\n"
