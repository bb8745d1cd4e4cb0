"""Run output: one directory per run, plus one row per run in ``runs.csv``.

Only the rank that serves (rank 0) writes; every other rank gets
:class:`NullResults`, whose methods do nothing, so training code calls the
same methods on every rank without asking who it is.

Nothing is ever half-written: JSON files are replaced atomically
(:mod:`mpitrain.atomic`); CSV files are append-only, one flushed line at a time; ``runs.csv`` is
appended under an exclusive lock and, when a newer mpitrain adds columns, rewritten
(atomically) with the union of the columns.
"""

from __future__ import annotations

import csv
import fcntl
import io
import os
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from .atomic import atomic_file, write_json_atomic
from .errors import ResultsError
from .schema import CURVE_COLUMNS

def _csv_line(values: Iterable) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if v is None else v for v in values])
    return buf.getvalue()


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


class CsvLog:
    """An append-only CSV file with a fixed header; each row is one flushed write."""

    def __init__(self, path: Path, columns: List[str]):
        self.path, self.columns = Path(path), list(columns)
        if not self.path.exists():
            self._write(_csv_line(self.columns))

    def append(self, row: Dict) -> None:
        self._write(_csv_line(_fmt(row.get(c)) for c in self.columns))

    def extend(self, rows: Iterable[Dict]) -> None:
        self._write("".join(_csv_line(_fmt(r.get(c)) for c in self.columns) for r in rows))

    def _write(self, text: str) -> None:
        # One write of whole lines, flushed: a killed process leaves complete rows.
        # No fsync per row: under heavy disk load it stalled rank 0 for seconds.
        with open(self.path, "a") as f:
            f.write(text)
            f.flush()


def append_run_row(path: Path, row: Dict) -> None:
    """Append ``row`` to the runs table at ``path``, safely against concurrent runs.

    Under an exclusive lock: if the existing header already has every column of
    ``row``, append one line; otherwise rewrite the table with the union of
    columns (old rows keep empty cells) through a temporary file and a rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        header: List[str] = []
        if path.exists() and path.stat().st_size:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
        missing = [c for c in row if c not in header]
        if not missing:
            with open(path, "a") as f:
                f.write(_csv_line(_fmt(row.get(c)) for c in header))
                f.flush()
                os.fsync(f.fileno())
            return
        columns = header + missing
        old_rows = read_csv(path) if header else []
        with atomic_file(path) as f:
            f.write(_csv_line(columns))
            for old in old_rows:
                f.write(_csv_line(old.get(c, "") for c in columns))
            f.write(_csv_line(_fmt(row.get(c)) for c in columns))


def read_csv(path: Path) -> List[Dict[str, str]]:
    """Rows of a CSV file as dicts; ResultsError naming the file if it is unreadable."""
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: cannot read ({e})") from None


def new_run_dir(results_dir: Path, stem: str) -> Path:
    """Create a fresh run directory ``results_dir/<time>-<stem>``; never reuse one."""
    results_dir = Path(results_dir)
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsError(f"cannot create results directory {results_dir} ({e.strerror}); "
                           "pass a writable --results-dir") from None
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"
    for attempt in range(1000):
        candidate = results_dir / (base if attempt == 0 else f"{base}-{attempt + 1}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ResultsError(f"cannot create a new run directory under {results_dir}")


class RunResults:
    """Rank 0's writer for one run's directory and its row in ``runs.csv``."""

    def __init__(self, results_dir: Path, stem: str, run_dir: Optional[Path] = None):
        self.results_dir = Path(results_dir)
        self.dir = run_dir if run_dir is not None else new_run_dir(self.results_dir, stem)
        self.curve = CsvLog(self.dir / "curve.csv", CURVE_COLUMNS)
        self._tensorboard = None
        self._status_facts: Dict[str, object] = {}

    def set_status(self, status: str, reason: str = "", **facts) -> None:
        """``status.json``: running while training, then ok / failed / interrupted.

        A run whose status.json still says running was killed without warning
        (SIGKILL, a node lost): its other files hold what it had written.
        ``facts`` (e.g. ``lost_workers``) are kept in every later status too.
        """
        self._status_facts.update(facts)
        self.write_json("status.json", {"status": status, "reason": reason,
                                        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                        **self._status_facts})

    @classmethod
    def reopen(cls, run_dir: Path) -> "RunResults":
        """Continue writing into an existing run directory (a resumed run)."""
        run_dir = Path(run_dir)
        if not (run_dir / "curve.csv").is_file():
            raise ResultsError(f"{run_dir}: not a run directory (no curve.csv)")
        return cls(run_dir.parent, "", run_dir)

    @property
    def path(self) -> Optional[Path]:
        return self.dir

    def write_json(self, name: str, obj) -> None:
        write_json_atomic(self.dir / name, obj)

    def add_curve_row(self, row: Dict) -> None:
        self.curve.append(row)

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        """TensorBoard scalars at ``step`` (``tensorboard --logdir results/`` shows them)."""
        if self._tensorboard is None:
            import tensorflow as tf

            self._tensorboard = tf.summary.create_file_writer(str(self.dir / "tensorboard"))
        with self._tensorboard.as_default(step=step):
            import tensorflow as tf

            for name, value in values.items():
                if value is not None and value == value:
                    tf.summary.scalar(name, value)
        self._tensorboard.flush()

    def write_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None:
        CsvLog(self.dir / name, columns).extend(rows)

    def add_run_row(self, row: Dict) -> None:
        append_run_row(self.results_dir / "runs.csv", {"run": self.dir.name, **row})

    def save_checkpoint(self, checkpoint, meanwhile=None) -> None:
        """Write ``checkpoint`` (:meth:`mpitrain.lifecycle.Checkpoint.save`: ``meanwhile``,
        the step's evaluation, runs while it is written)."""
        checkpoint.save(self.dir, meanwhile)


class NullResults:
    """What ranks that must not write get: the same methods, doing nothing."""

    path = None

    def write_json(self, name, obj):
        pass

    def add_curve_row(self, row):
        pass

    def scalars(self, step, values):
        pass

    def write_csv(self, name, columns, rows):
        pass

    def add_run_row(self, row):
        pass

    def save_checkpoint(self, checkpoint, meanwhile=None):
        if meanwhile is not None:  # the evaluation is not the file's to skip
            meanwhile()

    def set_status(self, status, reason="", **facts):
        pass
