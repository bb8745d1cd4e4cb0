"""One-command sweeps: the cross product of models, modes, ranks and batch sizes.

A spec (TOML, see ``experiments/``) or command-line lists define the grid::

    name = "lenet-nodes-batches"
    [grid]
    model = ["lenet"]
    mode = ["single", "sync"]
    np = [1, 3, 4]
    batch_size = [8, 64, 128, 256, 512]      # or batches_per_epoch = [1, 10, 50]
    epochs = [8]
    [options]                                 # extra mpitrain options for every run
    eval_every = 1

Combinations that cannot run are dropped (single needs -np 1, sync/async need
2 or more) and duplicates merged. Every run is a real ``mpirun ... python -m
mpitrain`` with the hostfile of its shape (``--cluster local``: this machine;
``--cluster cloudlab``: hostfiles/single, cluster, cluster2 for -np 1, 3, 4), run
one after another into one results directory. ``manifest.json`` there records
each run's state; running the same sweep again skips the runs already done,
so a sweep that was killed resumes where it stopped. The sweep ends by writing
the report (:func:`mpitrain.report.markdown.write_report`).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from . import dialect
from ..atomic import write_json_atomic
from ..errors import Interrupted, UsageError
from ..config.model_names import run_name  # a user's FILE.py:FUNCTION, file-name safe
from ..userfiles import read_bounded
from . import hostfile as hostfile_formats
from .preflight import check_launch

REPO = Path(__file__).resolve().parents[2]
GRID_KEYS = ("model", "mode", "np", "batch_size", "batches_per_epoch", "epochs")
CLOUDLAB = {1: "single", 3: "cluster", 4: "cluster2"}


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid."""

    model: str
    mode: str
    np: int
    epochs: Optional[int]
    batch_size: Optional[int] = None
    batches_per_epoch: Optional[int] = None

    @property
    def key(self) -> str:
        batch = (f"bs{self.batch_size}" if self.batch_size else
                 f"bpe{self.batches_per_epoch}" if self.batches_per_epoch else "bsdefault")
        epochs = f"e{self.epochs}" if self.epochs else "edefault"
        return f"{run_name(self.model)}-{self.mode}-np{self.np}-{batch}-{epochs}"

    def args(self, options: Dict[str, object]) -> List[str]:
        out = [self.model, "--async"] if self.mode == "async" else [self.model]
        for name in ("epochs", "batch_size", "batches_per_epoch"):
            value = getattr(self, name)
            if value is not None:
                out += [f"--{name.replace('_', '-')}", str(value)]
        for name, value in options.items():
            flag = f"--{name.replace('_', '-')}"
            if value is True:
                out.append(flag)
            elif value is not False and value is not None:
                out += [flag, str(value)]
        return out


def expand(grid: Dict[str, list]) -> List[SweepPoint]:
    """The runnable runs of ``grid``, in order, without duplicates."""
    unknown = set(grid) - set(GRID_KEYS)
    if unknown:
        raise UsageError(f"unknown sweep keys {sorted(unknown)}; use {', '.join(GRID_KEYS)}")
    if grid.get("batch_size") and grid.get("batches_per_epoch"):
        raise UsageError("a sweep sets batch_size or batches_per_epoch, not both")
    lists = {k: list(grid.get(k) or [None]) for k in GRID_KEYS}
    if lists["model"] == [None]:
        raise UsageError("a sweep needs at least one model")
    runs: List[SweepPoint] = []
    for model, mode, np_, batch, bpe, epochs in itertools.product(
            *(lists[k] for k in GRID_KEYS)):
        mode = mode or "sync"
        np_ = int(np_ or 1)
        if mode not in ("single", "sync", "async"):
            raise UsageError(f"unknown mode {mode!r} in the sweep (single, sync or async)")
        if mode == "single" or np_ == 1:
            if mode == "async":
                continue  # async needs a server and a worker
            mode, np_ = "single", 1
        run = SweepPoint(model, mode, np_, epochs and int(epochs), batch and int(batch),
                         bpe and int(bpe))
        if run not in runs:
            runs.append(run)
    if not runs:
        raise UsageError("the sweep has no runnable combination (async needs -np 2 or more)")
    return runs


def load_spec(path: Path) -> dict:
    """A TOML sweep spec: name, [grid], [options]; UsageError naming the file if bad."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, packaged as tomli
        import tomli as tomllib

    try:
        spec = tomllib.loads(read_bounded(path, error=UsageError).decode())
    except FileNotFoundError:
        raise UsageError(f"sweep spec {path} does not exist") from None
    except (OSError, ValueError) as e:  # TOMLDecodeError and UnicodeDecodeError too
        raise UsageError(f"sweep spec {path}: {e}") from None
    if "grid" not in spec:
        raise UsageError(f"sweep spec {path}: no [grid] table")
    return spec


class Sweep:
    """Runs a list of runs into one results directory, resumably."""

    def __init__(self, runs: List[SweepPoint], results_dir: Path, options: Dict[str, object],
                 cluster: str = "local", hostfile: Optional[str] = None,
                 python: str = sys.executable, report: bool = True):
        self.runs, self.results_dir, self.options = runs, Path(results_dir), options
        self.cluster, self.hostfile, self.python, self.report = cluster, hostfile, python, report
        self.manifest_path = self.results_dir / "manifest.json"
        self.logs = self.results_dir / "sweep-logs"

    def hostfile_for(self, np_: int) -> Optional[str]:
        """The hostfile for a run of ``np_`` ranks; None inside a SLURM allocation."""
        if self.hostfile:
            return self.hostfile
        if self.cluster == "slurm":
            return None  # mpirun takes the nodes from the allocation
        if self.cluster == "cloudlab":
            if np_ not in CLOUDLAB:
                raise UsageError(f"no CloudLab hostfile for -np {np_} (single: 1, cluster: 3, "
                                 "cluster2: 4); pass --hostfile")
            return str(REPO / "hostfiles" / CLOUDLAB[np_])
        return str(REPO / "hostfiles" / "local")

    def load_manifest(self) -> dict:
        if self.manifest_path.exists():
            try:
                return json.loads(read_bounded(self.manifest_path, error=UsageError))
            except (OSError, ValueError) as e:
                raise UsageError(f"{self.manifest_path}: unreadable ({e}); move it away to "
                                 "start the sweep afresh") from None
        return {"runs": {}}

    def save_manifest(self, manifest: dict) -> None:
        write_json_atomic(self.manifest_path, manifest)

    def run(self) -> int:
        """Run every run not done yet; returns the number that failed.

        SIGTERM or SIGINT stop the sweep gracefully: the running job gets SIGUSR1
        (it checkpoints and ends), is recorded as interrupted, and the sweep
        raises :class:`Interrupted`; running the sweep again resumes it.
        """
        self.stopping: Optional[str] = None
        lock = self._lock()
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM,
                                                                     signal.SIGINT)}
        try:
            return self._run_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(lock)

    def _lock(self) -> int:
        """The results directory's sweep.lock, held (an open descriptor) for the sweep:
        two sweeps into one directory would run every point twice. The kernel's lock
        (flock) ends with its process, so a killed sweep leaves no stale lock; the file
        names the holder's pid for the message."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.results_dir / "sweep.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{self.results_dir}: another mpitrain sweep (pid {holder}) is "
                             "running into this results directory; wait for it to end, or "
                             "give another --results-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def _stop(self, signum, frame) -> None:
        self.stopping = signal.Signals(signum).name
        current = getattr(self, "current", None)
        if current is not None and current.poll() is None:
            current.send_signal(signal.SIGUSR1)  # mpirun forwards it to every rank

    def _run_all(self) -> int:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        for run in self.runs:  # preflight every launch before starting any
            check_launch(run.np, self.hostfile_for(run.np), self.cluster == "slurm",
                         run.mode == "async")
        manifest = self.load_manifest()
        manifest["planned"] = [r.key for r in self.runs]
        failures = 0
        for i, run in enumerate(self.runs, 1):
            entry = manifest["runs"].get(run.key, {})
            if entry.get("status") == "done" and self._complete(entry):
                print(f"[{i}/{len(self.runs)}] {run.key}: done earlier, skipped", flush=True)
                continue
            entry = {"status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                     "args": run.args(self.options), "np": run.np}
            manifest["runs"][run.key] = entry
            self.save_manifest(manifest)
            code, run_dir, seconds = self._launch(run)
            status = "done" if code == 0 else "interrupted" if self.stopping else "failed"
            entry.update(status=status, exit_code=code, run_dir=run_dir,
                         seconds=round(seconds, 1))
            self.save_manifest(manifest)
            if self.stopping:
                raise Interrupted(f"sweep stopped by {self.stopping} during {run.key}; run the "
                                  "same command again to resume it", everywhere=True)
            failures += code != 0
            print(f"[{i}/{len(self.runs)}] {run.key}: "
                  + ("ok" if code == 0 else f"FAILED (exit {code}, see "
                                             f"{self.logs / (run.key + '.log')})")
                  + f" in {seconds:.0f} s", flush=True)
        if self.report:
            from ..report.markdown import write_report

            print(f"report: {write_report(self.results_dir)}", flush=True)
        return failures

    def _complete(self, entry: dict) -> bool:
        run_dir = entry.get("run_dir")
        status = Path(run_dir) / "status.json" if run_dir else None
        try:
            return bool(status) and json.loads(read_bounded(status))["status"] == "ok"
        except (OSError, ValueError, KeyError):
            return False

    def _launch(self, run: SweepPoint):
        hostfile = self.hostfile_for(run.np)
        try:  # in the dialect of the MPI found (see mpitrain.launch.dialect)
            runner = dialect.mpirun()
        except FileNotFoundError:
            raise UsageError("mpirun not found: install Open MPI or MPICH (bash setup.sh "
                             "installs Open MPI), or set MPITRAIN_MPIRUN") from None
        given = hostfile_formats.for_launcher(hostfile, runner.hostfile_format) \
            if hostfile else None
        cmd = [*runner.command(run.np, given,
                               keep_binding=bool(self.options.get("keep_cpu_binding"))),
               self.python, "-m", "mpitrain", *run.args(self.options),
               "--results-dir", str(self.results_dir), "--quiet"]
        env = dialect.launch_environment()
        t0 = time.monotonic()
        log = self.logs / f"{run.key}.log"
        with open(log, "w") as out:
            out.write(" ".join(cmd) + "\n")
            out.flush()
            self.current: Optional[subprocess.Popen] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            code = self.current.wait()
            self.current = None
        run_dir = None
        for line in log.read_text().splitlines():
            if line.startswith("results: "):
                run_dir = line[len("results: "):].strip()
        return code, run_dir, time.monotonic() - t0


def parse_list(text: Optional[str], kind=str) -> Optional[list]:
    return [kind(v) for v in text.split(",") if v] if text else None


def parse_value(text: str):
    """``--set key=value``: ints, floats and booleans become numbers and flags."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)
