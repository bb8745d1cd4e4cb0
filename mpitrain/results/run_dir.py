"""Run output: one directory per run, plus one row per run in ``runs.csv``.

Only the rank that serves (rank 0) writes; every other rank gets
:class:`NullResults`, whose methods do nothing, so training code calls the
same methods on every rank without asking who it is.

Nothing is ever half-written: JSON files are replaced atomically
(:mod:`mpitrain.atomic`); CSV files are append-only, whole lines at a time (a write a
full disk cuts short is undone), but for a table of the whole run that each session
writes whole (staleness.csv), replaced atomically; ``runs.csv`` is appended under an
exclusive lock and, when a newer mpitrain adds columns, rewritten (atomically) with
the union of the columns. A write that fails is one line (:func:`cannot_write`), and the
run is recorded as failed where there is room (see :class:`RunResults`).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..atomic import atomic_file, write_json_atomic, write_text_atomic
from ..errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, ResultsError, WriteError
from . import witness
from .schema import CURVE_COLUMNS
from ..userfiles import NotRegular, open_regular

#: bytes a run directory holds in reserve (``.reserve``) while its run writes: freed as
#: soon as a write fails, so that the failure can still be recorded there (status.json,
#: the runs.csv row) on a disk that filled up meanwhile
RESERVE_BYTES = 64 * 1024
RESERVE = ".reserve"
#: seconds between two notes of a running run's progress in its status.json
PROGRESS_NOTE_EVERY = 5.0


def _csv_line(values: Iterable) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if v is None else v for v in values])
    return buf.getvalue()


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def cannot_write(path, error: OSError) -> WriteError:
    """The one-line error for a write of ``path`` that failed with ``error``."""
    if isinstance(error, NotRegular):
        why = f"it is {error.kind}, not a regular file"
    else:
        number = -1 if error.errno is None else error.errno  # -1: no errno's
        why = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied"}.get(number, error.strerror or str(error))
        why += f" ({errno.errorcode[number]})" if number in errno.errorcode else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there or pass another --results-dir; what was written is intact"
    else:
        fix = "pass a --results-dir on a writable file system"
    return WriteError(f"cannot write {path}: {why}; {fix}")


def _append(path: Path, text: str, sync: bool = False) -> None:
    """Append ``text`` to the regular file ``path`` (created if missing) in one write, or
    not at all: a write that fails (a full disk) is cut back to the file's old end, so
    the file keeps whole lines. Never waits on a FIFO left in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC,
                 0o666)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(path, info.st_mode)
        data = memoryview(text.encode())
        try:
            while data:
                data = data[os.write(fd, data):]
            if sync:
                os.fsync(fd)
        except OSError:
            os.ftruncate(fd, info.st_size)
            raise
    finally:
        os.close(fd)


class CsvLog:
    """An append-only CSV file with a fixed header; each row is one flushed write."""

    def __init__(self, path: Path, columns: Sequence[str]):
        self.path, self.columns = Path(path), list(columns)
        if not self.path.exists():
            self._write(_csv_line(self.columns))

    def append(self, row: Dict) -> None:
        self._write(_csv_line(_fmt(row.get(c)) for c in self.columns))

    def extend(self, rows: Iterable[Dict]) -> None:
        self._write("".join(_csv_line(_fmt(r.get(c)) for c in self.columns) for r in rows))

    def _write(self, text: str) -> None:
        # One write of whole lines: a killed process leaves complete rows. No fsync per
        # row: under heavy disk load it stalled rank 0 for seconds.
        _append(self.path, text)


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
            with open_regular(path) as f:
                header = next(csv.reader(io.TextIOWrapper(f, newline="")), [])
        missing = [c for c in row if c not in header]
        if not missing:
            _append(path, _csv_line(_fmt(row.get(c)) for c in header), sync=True)
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
        with open_regular(path) as f:
            return list(csv.DictReader(io.TextIOWrapper(f, newline="")))
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: cannot read ({e})") from None


def new_run_dir(results_dir: Path, stem: str) -> Path:
    """Create a fresh run directory ``results_dir/<time>-<stem>``; never reuse one.
    OSError if it cannot be made (see :func:`cannot_write`)."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"
    for attempt in range(1000):
        candidate = results_dir / (base if attempt == 0 else f"{base}-{attempt + 1}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ResultsError(f"cannot create a new run directory under {results_dir}")


def engine_name(config: dict) -> str:
    """What moved the gradients: mpi or horovod (sync), ps (async), none (one worker);
    ``config``: a run's settings as config.json holds them (Config.to_dict)."""
    if config["mode"] == "async":
        return "ps"
    return config["allreduce"] if config["workers"] > 1 else "none"


def run_identity(config: dict, dataset: dict, status: str, reason: str = "",
                 rescaled: str = "", horovod_version: str = "") -> dict:
    """A run's row in runs.csv as far as its settings tell, from config.json's
    ``config`` (Config.to_dict) and ``dataset`` sections: what ran, and how it ended
    (``status``, ``reason``); ``rescaled``: how the session continued the run on
    another number of ranks."""
    return {"model": config["model"], "mode": config["mode"], "np": config["world_size"],
            "workers": config["workers"], "batch_size": config["batch_size"],
            "global_batch": config["global_batch"], "optimizer": config["optimizer"],
            "lr": config["effective_lr"], "dataset": dataset["name"],
            "input_shape": "x".join(map(str, dataset["input_shape"])),
            "num_classes": dataset["num_classes"], "status": status, "reason": reason,
            "resumed": bool(config.get("resume")), "rescaled": rescaled,
            "engine": engine_name(config), "compression": config["compression"],
            "horovod_version": horovod_version,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID", "")}


class RunResults:
    """Rank 0's writer for one run's directory and its row in ``runs.csv``.

    Every write of the run's results goes through it, and a write that fails (a full
    disk, a read-only file system) is one :class:`~mpitrain.errors.WriteError` line
    naming the file and the fix. The directory keeps :data:`RESERVE_BYTES` in reserve
    while the run writes, freed at the first failed write, so the failure can still be
    recorded in status.json and runs.csv (:func:`mpitrain.run.session.record_failure`);
    every file is appended whole or replaced whole, so those already written stay
    intact.
    """

    def __init__(self, results_dir: Path, stem: str, run_dir: Optional[Path] = None):
        self.results_dir = Path(results_dir)
        self._tensorboard: Any = None  # tf.summary's writer, made at the first scalars
        self._status_facts: Dict[str, object] = {}
        self._status = ("", "")  # the last set_status's status and reason
        self._next_progress_note = 0.0  # (monotonic) see note_progress
        self._reserve: Optional[Path] = None
        self._resumed = run_dir is not None
        self._witness: Any = None  # a Witness from the first running status on
        with self._writing(run_dir or self.results_dir):
            self.dir = run_dir if run_dir is not None else new_run_dir(self.results_dir, stem)
        try:
            with self._writing(self.dir):
                self._reserve = self.dir / RESERVE
                with atomic_file(self._reserve, "wb") as f:
                    f.write(bytes(RESERVE_BYTES))
                self.curve = CsvLog(self.dir / "curve.csv", CURVE_COLUMNS)
        except WriteError:
            if run_dir is None:  # a new directory: nothing of it is left (if empty)
                with contextlib.suppress(OSError):
                    self.dir.rmdir()
            raise

    @contextlib.contextmanager
    def _writing(self, path):
        """Where the run's files are written: an OSError becomes the WriteError naming
        ``path``, after the reserve is freed for the record of the failure."""
        try:
            yield
        except OSError as e:
            self._free_reserve()
            raise cannot_write(path, e) from None

    def _free_reserve(self) -> None:
        if self._reserve is not None:
            self._reserve.unlink(missing_ok=True)
            self._reserve = None

    def set_status(self, status: str, reason: str = "", **facts) -> None:
        """``status.json``: running while training, then ok / failed / interrupted.

        A run whose status.json still says running after its job is gone lost rank 0's
        host (rank 0 killed otherwise is recorded by its witness): its other files hold
        what it had written. ``facts`` (e.g. ``lost_workers``) are kept in every later status too.
        Once the run has ended, the directory's reserve is given back. From the first
        running status on, a witness records the run should this process die before it
        records an end (:mod:`mpitrain.results.witness`).
        """
        self._status_facts.update(facts)
        self._status = (status, reason)
        self._write_status(durable=True)
        if status == "running" and self._witness is None:
            self._witness = self._start_witness()
        elif status != "running" and self._status_facts.get("runs_csv") != "pending" \
                and self._witness:
            self._witness.dismiss()  # the end and its row are recorded
        if status != "running":
            self._free_reserve()

    def note_progress(self, step: int) -> None:
        """While the run says running: status.json's ``step`` (the updates done, in the
        checkpoint's unit), rewritten at most every PROGRESS_NOTE_EVERY seconds, and kept
        in the status the run ends with. mpitrain launch counts the steps a failure lost
        by it (its checkpoint's step is where the run goes on from)."""
        now = time.monotonic()
        if self._status[0] == "running" and now >= self._next_progress_note:
            self._next_progress_note = now + PROGRESS_NOTE_EVERY
            self._status_facts["step"] = step
            # no fsync on the training thread for a note the next one replaces (CsvLog's
            # rows skip it for the same reason)
            self._write_status(durable=False)

    def _write_status(self, durable: bool) -> None:
        status, reason = self._status
        with self._writing(self.dir / "status.json"):
            write_json_atomic(self.dir / "status.json", {
                "status": status, "reason": reason,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **self._status_facts},
                durable=durable)

    def _start_witness(self):
        if os.environ.get(ATTEMPT_ENV):
            return False  # mpitrain launch records an attempt whose rank 0 was lost
        try:
            rows_before = run_rows(self.dir)
        except ResultsError:
            return False  # runs.csv unreadable: there is no row to add to
        return witness.start(self.dir, self._resumed, rows_before) or False

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
        with self._writing(self.dir / name):
            write_json_atomic(self.dir / name, obj)

    def add_curve_row(self, row: Dict) -> None:
        with self._writing(self.curve.path):
            self.curve.append(row)

    def scalars(self, step: int, values: Dict[str, Optional[float]]) -> None:
        """TensorBoard scalars at ``step`` (``tensorboard --logdir results/`` shows them)."""
        import tensorflow as tf

        where = self.dir / "tensorboard"
        try:
            with self._writing(where):
                if self._tensorboard is None:
                    self._tensorboard = tf.summary.create_file_writer(str(where))
                with self._tensorboard.as_default(step=step):
                    for name, value in values.items():
                        if value is not None and value == value:
                            tf.summary.scalar(name, value)
                self._tensorboard.flush()
        except tf.errors.OpError as e:  # TensorFlow's own file errors
            self._free_reserve()
            raise WriteError(f"cannot write {where}: {e.message.splitlines()[0]}; pass a "
                             "--results-dir with room to write") from None

    def write_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None:
        with self._writing(self.dir / name):
            CsvLog(self.dir / name, columns).extend(rows)

    def replace_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None:
        """Replace ``name`` (atomically) with ``rows``: a table of the whole run that
        each session writes whole, such as the async server's staleness counts (which a
        resumed run carries on from its checkpoint), where appending would count a
        resumed run's earlier sessions twice."""
        text = _csv_line(columns) + "".join(_csv_line(_fmt(r.get(c)) for c in columns)
                                            for r in rows)
        with self._writing(self.dir / name):
            write_text_atomic(self.dir / name, text)

    def add_run_row(self, row: Dict) -> None:
        path = self.results_dir / "runs.csv"
        with self._writing(path):
            append_run_row(path, {"run": self.dir.name, **row})

    def save_checkpoint(self, checkpoint, meanwhile=None) -> None:
        """Write ``checkpoint`` (:meth:`mpitrain.run.checkpoint.Checkpoint.save`: ``meanwhile``,
        the step's evaluation, runs while it is written)."""
        with self._writing(self.dir / "checkpoint.npz"):
            checkpoint.save(self.dir, meanwhile)


#: the exit code of a run whose status.json says it ended so (see RunResults.set_status)
EXIT_CODE_OF_STATUS = {"ok": EXIT_OK, "failed": EXIT_FAILURE, "interrupted": EXIT_INTERRUPTED}


def run_ended(status: Optional[dict]) -> bool:
    """True if ``status`` (status.json's content) says the run has ended."""
    value = status.get("status") if status else None
    return isinstance(value, str) and value in EXIT_CODE_OF_STATUS


def run_rows(run_dir: Path) -> int:
    """How many rows of its results directory's runs.csv are the run's (0 when there is
    no runs.csv yet); ResultsError if it cannot be read."""
    table = Path(run_dir).parent / "runs.csv"
    if not table.exists():
        return 0
    return sum(row.get("run") == Path(run_dir).name for row in read_csv(table))


class NullResults:
    """What ranks that must not write get: the same methods, doing nothing (both are
    checked against :class:`mpitrain.train.context.ResultsWriter` by mypy)."""

    path: Optional[Path] = None

    def write_json(self, name: str, obj: object) -> None:
        pass

    def add_curve_row(self, row: Dict) -> None:
        pass

    def scalars(self, step: int, values: Dict[str, Optional[float]]) -> None:
        pass

    def write_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None:
        pass

    def replace_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None:
        pass

    def add_run_row(self, row: Dict) -> None:
        pass

    def save_checkpoint(self, checkpoint: object,
                        meanwhile: Optional[Callable[[], object]] = None) -> None:
        if meanwhile is not None:  # the evaluation is not the file's to skip
            meanwhile()

    def set_status(self, status: str, reason: str = "", **facts: object) -> None:
        pass

    def note_progress(self, step: int) -> None:
        pass


#: the environment variable that carries ``mpitrain launch``'s attempt token to every rank
ATTEMPT_ENV = "MPITRAIN_LAUNCH_ATTEMPT"
#: set by mpitrain launch for a script: where a mpitrain.horovod.elastic state is written
#: (by rank 0) and read back by the next attempt of the launch
ELASTIC_ENV = "MPITRAIN_ELASTIC_STATE"


def attempt_facts(environ=os.environ) -> dict:
    """What rank 0 records in each status.json for ``mpitrain launch``: the attempt's
    token (``launch_attempt``, when run by the launcher) and the writing process
    (``writer``, :func:`process_identity`)."""
    token = environ.get(ATTEMPT_ENV)
    return {**({"launch_attempt": token} if token else {}), "writer": process_identity()}


def process_identity() -> dict:
    """This process as another process can tell whether it sees it: its pid, the kernel's
    boot id and the inode of its pid namespace (None where they cannot be read). A host
    name would not do: the nodes of a network-namespace cluster have names of their own
    and share this machine's processes."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = None
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    return {"pid": os.getpid(), "boot_id": boot_id, "pid_ns": pid_ns}


def writer_visible(writer, here: dict) -> bool:
    """True if the process ``writer`` (status.json's, see :func:`process_identity`) is
    one this process could see: the same boot, the same pid namespace (``here``: this
    process's identity)."""
    return (isinstance(writer, dict) and isinstance(writer.get("pid"), int)
            and here["boot_id"] is not None and here["pid_ns"] is not None
            and writer.get("boot_id") == here["boot_id"]
            and writer.get("pid_ns") == here["pid_ns"])


def is_running(pid: int) -> bool:
    """True if process ``pid`` exists here and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess is one too
        return False
    except psutil.Error:  # AccessDenied: it is there
        return True


def running_writer(status: Optional[dict], here: dict) -> Optional[int]:
    """The pid of the writer ``status`` (a status.json's content) names when it says
    running and that writer is visible from here (``here``: :func:`process_identity`);
    None otherwise (an end, no writer named, one on another host or container)."""
    if not status or status.get("status") != "running":
        return None
    return status["writer"]["pid"] if writer_visible(status.get("writer"), here) else None


def live_writer(status: Optional[dict]) -> Optional[int]:
    """The pid of another process still writing the run whose status.json says
    ``status`` (:func:`running_writer`, and it runs); None otherwise."""
    pid = running_writer(status, process_identity())
    return pid if pid is not None and pid != os.getpid() and is_running(pid) else None
