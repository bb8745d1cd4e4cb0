"""Where a launch's hosts come from, and how they are read again while the job runs:
a hostfile (read again when it changes), a host discovery script (run every
DISCOVERY_EVERY seconds), or the SLURM allocation the launcher runs in.

A discovery script keeps Horovod's contract (``horovodrun --host-discovery-script``):
an executable that prints the hosts available now, one per line, ``HOST:SLOTS`` (or
``HOST`` for one slot; a hostfile's ``HOST slots=N`` is read too), and exits 0; no line
means no host. A script that exits non-zero, prints what cannot be read, or does not
finish within DISCOVERY_TIMEOUT (killed, with whatever it started) leaves the hosts as
they were, said in one line (once until it answers again). A host it lists is not
trusted: it joins only once mpirun can start a process there (see
:mod:`.membership`).

Outside the job: no TensorFlow, no MPI.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from typing import Callable, List, Optional, Protocol, Tuple

from . import hostfile
from ..errors import UsageError
from .watch import kill_tree

#: seconds a discovery script gets to print the hosts before it is killed
DISCOVERY_TIMEOUT = 10.0
#: seconds between two runs of a discovery script while the job runs (Horovod's: 1)
DISCOVERY_EVERY = 1.0

#: what a poll found: the hosts, if they changed since they were last read, and the
#: lines to say (a source that cannot be read now)
Found = Tuple[Optional[List[hostfile.Host]], List[str]]


class HostSource(Protocol):
    """Where the hosts come from; ``where`` names it in messages."""

    where: str

    def read(self) -> List[hostfile.Host]:
        """The hosts now (blocking, bounded); UsageError, one line, if they cannot be
        read."""

    def poll(self) -> Found:
        """Without blocking: the hosts if they changed since the last read or poll."""


class HostfileSource:
    """A hostfile, read again when its modification time or size changes."""

    def __init__(self, path: str):
        self.path = self.where = path
        self._stamp = _stamp_of(path)

    def read(self) -> List[hostfile.Host]:
        self._stamp = _stamp_of(self.path)
        return hostfile.read(self.path)

    def poll(self) -> Found:
        stamp = _stamp_of(self.path)
        if stamp == self._stamp:
            return None, []
        try:
            return self.read(), []
        except UsageError as e:
            self._stamp = stamp  # (said once per change)
            return None, [f"the hostfile changed but cannot be read ({e}): the hosts stay "
                          "as they were"]


def _stamp_of(path: Optional[str]) -> Optional[tuple]:
    """What tells a changed file: (modification time, size); None if it cannot be read."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st else None


class DiscoveryScript:
    """A host discovery script (see the module docstring): :meth:`read` runs it and
    waits; :meth:`poll` runs it on a thread every ``every`` seconds and reports what the
    last run found."""

    def __init__(self, path: str, timeout: float = DISCOVERY_TIMEOUT,
                 every: float = DISCOVERY_EVERY, clock: Callable[[], float] = time.monotonic):
        self.path, self.timeout, self.every, self.clock = path, timeout, every, clock
        self.where = f"discovery script {path}"
        self.last: Optional[List[hostfile.Host]] = None
        self._said: Optional[str] = None  # the failure said last (said once)
        self._started = -float("inf")
        self._running: Optional[threading.Thread] = None
        self._result: Optional[Tuple[Optional[List[hostfile.Host]], str]] = None

    def read(self) -> List[hostfile.Host]:
        self.last = self._run()
        return self.last

    def poll(self) -> Found:
        found: Found = (None, [])
        if self._running is not None and not self._running.is_alive():
            self._running = None
            hosts, failure = self._result or (None, "")
            if failure:
                found = (None, [f"{failure}: the hosts stay as they were"]
                         if failure != self._said else [])
                self._said = failure
            elif hosts != self.last:
                self.last, self._said = hosts, None
                found = (hosts, [])
            else:
                self._said = None
        if self._running is None and self.clock() - self._started >= self.every:
            self._started = self.clock()
            self._running = threading.Thread(target=self._run_for_poll, daemon=True,
                                             name="mpitrain launch host discovery")
            self._running.start()
        return found

    def _run_for_poll(self) -> None:
        try:
            self._result = (self._run(), "")
        except UsageError as e:
            self._result = (None, str(e))

    def _run(self) -> List[hostfile.Host]:
        """Run the script once; its hosts, or UsageError (one line) saying why not."""
        try:
            proc = subprocess.Popen([self.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        except OSError as e:
            raise UsageError(f"{self.where} cannot be run ({e.strerror}): give the path of "
                             "an executable (chmod +x) that prints HOST:SLOTS lines") from None
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # (and what it started, which may hold its output open)
            proc.communicate()
            raise UsageError(f"{self.where} did not finish within {self.timeout:g} s "
                             "(killed)") from None
        if proc.returncode != 0:
            last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()),
                        "")
            raise UsageError(f"{self.where} exited {proc.returncode}"
                             + (f" ({last})" if last else ""))
        if not re.sub(r"#.*", "", out).strip():
            return []
        return hostfile.parse(out, self.where)


class SlurmAllocation:
    """The nodes of the SLURM allocation the launcher runs in, each with the tasks SLURM
    gives it (``$SLURM_JOB_NODELIST`` expanded by ``scontrol show hostnames``, the
    counts from ``$SLURM_TASKS_PER_NODE``); it does not change while the job runs."""

    def __init__(self, environ=os.environ):
        self.environ = environ
        self.where = f"the SLURM allocation of job {environ.get('SLURM_JOB_ID', '?')}"

    def read(self) -> List[hostfile.Host]:
        nodelist = self.environ.get("SLURM_JOB_NODELIST") or self.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise UsageError(f"{self.where}: $SLURM_JOB_NODELIST is not set; run the launch "
                             "inside the allocation (sbatch or salloc) or give -hostfile")
        try:
            shown = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                                   capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError(f"{self.where}: 'scontrol show hostnames' failed ({e}); give "
                             "-hostfile") from None
        names = shown.stdout.split()
        if shown.returncode != 0 or not names:
            raise UsageError(f"{self.where}: 'scontrol show hostnames {nodelist}' exited "
                             f"{shown.returncode} ({shown.stderr.strip()}); give -hostfile")
        counts = tasks_per_node(self.environ.get("SLURM_TASKS_PER_NODE", ""), len(names))
        return [hostfile.Host(name, count) for name, count in zip(names, counts)]

    def poll(self) -> Found:
        return None, []


def tasks_per_node(text: str, nodes: int) -> List[int]:
    """SLURM's compressed per-node counts (``2(x3),1``) for ``nodes`` nodes; one task a
    node where they are missing or do not match the nodes."""
    counts: List[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return [1] * nodes
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts if len(counts) == nodes and all(counts) else [1] * nodes


def host_source(hostfile_path: Optional[str], script: Optional[str],
                ranged: Optional[Tuple[int, int]]) -> Optional[HostSource]:
    """Where a launch's hosts come from: -hostfile, --host-discovery-script, or with
    -np MIN:MAX (``ranged``) the SLURM allocation the launcher runs in; None: this
    machine, or mpirun's own reading of a SLURM allocation. UsageError, one line, for
    both a hostfile and a script, or a MIN:MAX with no source of hosts."""
    if script and hostfile_path:
        raise UsageError("give -hostfile FILE or --host-discovery-script SCRIPT, not both")
    if script:
        return DiscoveryScript(script)
    if hostfile_path:
        return HostfileSource(hostfile_path)
    if ranged and os.environ.get("SLURM_JOB_ID"):
        return SlurmAllocation()
    if ranged:
        raise UsageError(f"-np {ranged[0]}:{ranged[1]} takes the hosts that answer from a "
                         "hostfile, a discovery script or a SLURM allocation: give -hostfile "
                         "FILE or --host-discovery-script SCRIPT (or -np N)")
    return None
