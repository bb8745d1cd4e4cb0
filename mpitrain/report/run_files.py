"""A run directory's files, read and validated: :func:`load_run` -> :class:`Run`.

Input is read with the ``csv`` module and validated: a directory that is not a run, or a
missing, empty, half-written or non-numeric file raises
:class:`~mpitrain.errors.ResultsError` with one line naming the file. Optional files
(``telemetry.csv`` when sampling was off, ``staleness.csv`` for sync runs, ...) may be
absent. What each file holds, column by column, is :mod:`mpitrain.results.schema` (shared with
the writers). For :mod:`.plots` and :mod:`.report`; no matplotlib.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..config.sections import staleness_bound
from ..errors import ResultsError
from ..results.schema import CURVE, OPTIONAL_TABLES, Column
from ..userfiles import NotRegular, open_regular

MB = 2**20
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
    #: where each session after the first begins on the telemetry's time axis
    restarts: List[float] = field(default_factory=list)

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

    @property
    def staleness_bound(self) -> Optional[int]:
        """The async run's staleness bound (its --staleness at its workers); None:
        unbounded."""
        value = self.setting("staleness")
        return staleness_bound(value if value in (None, "auto", "none") else _int(value),
                               self.workers)

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
    restarts: List[float] = []
    if tables["telemetry"] is not None:
        tables["telemetry"], restarts = sessions_in_sequence(tables["telemetry"])
    return Run(path, meta, curve, tables, dict(row or {}), restarts)


def sessions_in_sequence(telemetry: Table) -> Tuple[Table, List[float]]:
    """A resumed run's telemetry.csv holds each session's samples after the last, each
    session timed from its own start (its rows in time order): the table with each
    session shifted to begin where the one before ended, and where each later one
    begins."""
    times = telemetry["time_s"].copy()
    starts = np.flatnonzero(np.diff(times) < 0) + 1  # (a time lower than the row before)
    restarts = []
    for begin, end in zip(starts, [*starts[1:], len(times)]):
        offset = float(times[begin - 1])  # (the session before, already shifted)
        times[begin:end] += offset
        restarts.append(offset)
    columns = {**telemetry.columns, "time_s": times}
    return Table(telemetry.path, columns, len(telemetry)), restarts
