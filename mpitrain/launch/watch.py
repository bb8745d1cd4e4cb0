"""What ``mpitrain launch`` learns of an attempt while its mpirun runs: the run's
status.json (has the attempt's run ended, by its own word? is its rank 0 gone?) and the
processes it started (killed as a tree).

Only the launcher (:mod:`mpitrain.launch.job`) uses it; it reads what rank 0 writes
(:mod:`mpitrain.results.run_dir`: ``status.json`` with the attempt's token and its writer) and
never blocks on a file (:mod:`mpitrain.userfiles`).

Once the run has ended by its own word (rank 0's ``status.json`` says ok,
failed or interrupted) mpirun gets ``TEARDOWN_GRACE`` seconds to exit: Open
MPI can take minutes to tear down a job whose daemon on a lost host it cannot
reach. Past them the launcher says so in one line, kills
the job's process group and goes on as if mpirun had exited as the run did
(failed: 1, and the usual restart; interrupted: 143; ok: 0). Rank 0 can also
die before it records an end (killed; when a host is lost, Open MPI kills the
ranks), its status.json left at running. When rank 0 is a process the launcher
can see (the same boot and pid namespace: this machine, or a network-namespace
node of it) and it is gone (or a zombie), mpirun again gets ``TEARDOWN_GRACE``
seconds; past them the launcher says so in one line, kills the job and goes on
as after a failure (1, and the usual restart). With rank 0 on another host,
mpirun's exit is waited for.

Each attempt has a token of its own, given to every rank as
``$MPITRAIN_LAUNCH_ATTEMPT`` (``mpirun -x``); rank 0 records it in every
status.json it writes, with who writes (``writer``: pid, boot id, pid namespace;
see :func:`mpitrain.results.run_dir.attempt_facts`). The attempt's run directory is the
one (resumed, or new under ``--results-dir``) whose status.json carries the token, so neither the
status.json of the attempt before nor another run sharing the results directory
counts. The launcher looks at it once a second; until rank 0 has written it
(it says running once the run is set up), mpirun's exit is waited for. Each
attempt's status and reason also stay in its ``runs.csv`` row (rank 0 writes it
right after the status; the next attempt rewrites status.json). When rank 0 was
killed before it wrote the row (also before it wrote the attempt's first status,
the run's status.json still an earlier attempt's), the launcher writes it: an
attempt has its row when the run has one more in runs.csv than when it began
(:func:`mpitrain.results.lost_run.record_lost_attempt`).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, List, Optional, cast

from ..errors import EXIT_FAILURE, EXIT_OK
from ..results.run_dir import (ATTEMPT_ENV, EXIT_CODE_OF_STATUS, is_running, process_identity,
                               run_ended, running_writer)
from ..userfiles import read_json_object


class RunWatch:
    """Follows the status.json of the run one attempt writes, so that the launcher knows
    when the run has ended, or its rank 0 is gone, while mpirun still runs.

    The attempt's status.json is the one that carries its ``token``: in the resumed run
    directory, or in a new one under the results directory (one that was not there
    when the watch began). Each poll reads that file (until it is known, the
    status.json of each candidate directory) and, while it says running, looks up its
    writer's process if that is visible here.
    """

    def __init__(self, results_dir: Path, resumed: Optional[Path], token: str,
                 clock=time.monotonic):
        self.results_dir, self.resumed, self.token, self.clock = (results_dir, resumed,
                                                                  token, clock)
        self._names_before = set() if resumed else _listing(results_dir)
        self.run_dir: Optional[Path] = None  # known once a status.json carries the token
        self.status: Optional[dict] = None  # the attempt's last status read
        self.ended_at: Optional[float] = None  # clock() when the run was first seen ended
        self.gone_at: Optional[float] = None  # clock() when its running writer was seen gone
        self._here = process_identity()
        self.began = clock()

    def poll(self) -> None:
        """Look at the attempt's status.json once, if the run has not ended already."""
        if self.ended_at is not None:
            return
        for run_dir in [self.run_dir] if self.run_dir else self._candidates():
            status = read_json_object(run_dir / "status.json")
            if is_attempts(status, self.token):
                self.run_dir, self.status = run_dir, status
                break
        else:  # not written yet, another run's or attempt's, or caught mid-replacement
            return
        if run_ended(self.status):
            self.ended_at = self.clock()
        elif self.gone_at is None and writer_gone(self.status, self._here):
            self.gone_at = self.clock()

    def overdue(self, grace: float) -> bool:
        """True once the run ended ``grace`` seconds ago or more."""
        return teardown_overdue(self.ended_at, self.clock(), grace)

    def writer_gone_overdue(self, grace: float) -> bool:
        """True once rank 0, its status running, was seen gone ``grace`` seconds ago or
        more (and the run has not been seen ending since)."""
        return self.ended_at is None and teardown_overdue(self.gone_at, self.clock(), grace)

    def never_started(self, bound: float) -> bool:
        """True once ``bound`` seconds passed since the watch began without the attempt's
        status.json (mpirun never started the job's ranks: a daemon that never
        answered it)."""
        return self.status is None and self.clock() - self.began >= bound

    def _candidates(self) -> List[Path]:
        if self.resumed:
            return [self.resumed]
        return sorted(self.results_dir / name
                      for name in _listing(self.results_dir) - self._names_before)


def is_attempts(status: Optional[dict], token: str) -> bool:
    """True if ``status`` (a status.json's content) was written by the attempt whose token
    is ``token``."""
    return bool(status and status.get("launch_attempt") == token)


def writer_gone(status: Optional[dict], here: dict) -> bool:
    """True if ``status`` says running and its writer is a process visible from here that
    no longer runs (exited, or a zombie). False where that cannot be told (a writer on
    another host, or none named)."""
    pid = running_writer(status, here)
    return pid is not None and not is_running(pid)


def restartable(run_dir: Optional[Path]) -> bool:
    """False if the run's status.json says a restart would fail the same way (its
    results could not be written: see mpitrain.run.session.record_failure)."""
    status = read_json_object(run_dir / "status.json") if run_dir else None
    return not status or status.get("restartable") is not False


def teardown_overdue(ended_at: Optional[float], now: float, grace: float) -> bool:
    """True if the run ended (at ``ended_at``; None: not yet) ``grace`` seconds or more
    before ``now``."""
    return ended_at is not None and now - ended_at >= grace


def describe(status: dict) -> str:
    """A status on one line: ``failed: <reason>``, or ``ok``."""
    reason = next((line.strip() for line in str(status.get("reason") or "").splitlines()
                   if line.strip()), "")
    return f"{status['status']}: {reason}" if reason else str(status["status"])


def _listing(directory: Path) -> set:
    """The names in ``directory`` (none if it is not there yet)."""
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of ``pid``, including those
    in sessions of their own (the launcher's mpirun, when ``pid`` is the launcher)."""
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # nothing left in it
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass


def kill_strays(token: str) -> int:
    """SIGKILL every process on this host whose environment carries the attempt's
    ``token`` (ATTEMPT_ENV, which mpirun exports to every rank): ranks that outlived
    mpirun's session because the daemon that started them left it (Open MPI's orted
    daemonizes). How many there were."""
    import psutil

    killed = 0
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(ATTEMPT_ENV) == token:
                proc.kill()
                killed += 1
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return killed


def run_dirs(results_dir: Path) -> set:
    """The run directories under ``results_dir`` (those with a config.json)."""
    if not results_dir.is_dir():
        return set()
    return {p for p in results_dir.iterdir() if (p / "config.json").is_file()}


class ErrorTail:
    """A script's stderr passed on to the launcher's as it comes, attempt after attempt,
    its last lines kept: what each failure said, to tell a restart that would fail the
    same way (the same exit code and the same last error line, twice) from one that may
    help."""

    KEEP = 40

    def __init__(self) -> None:
        self.lines: collections.deque = collections.deque(maxlen=self.KEEP)
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[tuple] = None  # the last attempt's (exit code, signature)

    def follow(self, stream: IO[bytes]) -> None:
        """Pass ``stream`` (a new attempt's stderr) on, keeping its lines."""
        self.lines.clear()
        self._thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self._thread.start()

    def _copy(self, stream: IO[bytes]) -> None:
        out = sys.stderr.buffer
        for line in iter(stream.readline, b""):
            out.write(line)
            out.flush()
            self.lines.append(line.decode(errors="replace").rstrip())
        stream.close()

    @property
    def last_error(self) -> str:
        """The attempt's last line that reads as an error ('' if none did)."""
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # (mpirun has exited: the pipe is closing)
        return next((line.strip() for line in reversed(self.lines)
                     if re.search(r"error|exception|abort|killed|fault", line, re.I)), "")

    def failed_the_same_way(self, code: int) -> bool:
        """True if the attempt that just failed with ``code`` failed as the one before it
        did: the same code and last error line, its numbers masked (pids, ranks and
        times differ from one attempt to the next)."""
        failure = (code, re.sub(r"\d+", "N", self.last_error))
        same, self._failure = bool(failure[1]) and failure == self._failure, failure
        return same


def recorded_code(code: int, status: Optional[dict], records: bool = True) -> int:
    """The job's exit code: mpirun's ``code``, unless the run recorded an end of another
    kind in ``status`` (status.json's content): Open MPI 4's mpirun under
    --enable-recovery exits 0 whatever its ranks return (or 1, ended by SIGTERM), so a
    stopped async run there said 0 and the launcher took it for finished. A run that
    ``records`` its end (the CLI's; a script's does not) and recorded none failed, whatever
    mpirun says: Open MPI 5's under ULFM exits 0 once every rank has died."""
    if not run_ended(status):
        return EXIT_FAILURE if records and code == EXIT_OK else code
    recorded = EXIT_CODE_OF_STATUS.get(cast(dict, status)["status"], code)
    if recorded != EXIT_OK and code in (EXIT_OK, EXIT_FAILURE):
        return recorded  # (a run that recorded ok keeps any failure mpirun saw after)
    return code
