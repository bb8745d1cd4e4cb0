"""A run's witness: a small process that outlives rank 0 and records the run when rank 0
dies before it could say how the run ended.

Rank 0 records every end it sees (ok, failed, interrupted: status.json, then the run's
row in runs.csv). It cannot record its own death: SIGKILL, the out-of-memory killer, or
mpirun ending every rank after another rank died of a signal (a worker's native crash
in a kernel is one). Its status.json would then say running for ever, and runs.csv
would have no row. Under ``mpitrain launch`` the launcher writes that record
(:func:`~mpitrain.results.lost_run.record_lost_attempt`); under a plain mpirun, srun or
any other launcher, the witness does.

Rank 0 starts it (:func:`start`, from :meth:`RunResults.set_status` when the run first
says running) in a session of its own, so that the signals mpirun sends to end the job
do not reach it, holding the write end of a pipe whose read end is the witness's stdin.
The witness blocks reading it, which costs nothing while the run trains, and sees
end-of-file the moment rank 0's process is gone, however it ended, or when rank 0
closes it after recording the run's end (a process may train many runs:
``mpitrain.fit`` in a loop). It then reads the run's status.json: if rank 0 had
recorded an end with its row, there is nothing to do (the usual case); if the status
still says running, written by that process, or an end whose row was still pending,
it records the attempt as failed (or as the end it had said) with its row
(:mod:`mpitrain.results.lost_run`), and exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional


class Witness:
    """Rank 0's end of a started witness: the pipe's write end, held while the run
    trains; :meth:`dismiss` once the run has recorded its end (the witness then looks,
    finds the record, and exits)."""

    def __init__(self, process: subprocess.Popen, pipe: int):
        self.process, self.pipe = process, pipe

    def dismiss(self) -> None:
        if self.pipe >= 0:
            os.close(self.pipe)
            self.pipe = -1
        _reap()


#: the witnesses started by this process that may still run: kept so that none is
#: left unwaited (a zombie, and Popen's ResourceWarning), reaped at each start/dismiss
_started: List[subprocess.Popen] = []


def _reap() -> None:
    _started[:] = [process for process in _started if process.poll() is None]


def start(run_dir: Path, resumed: bool, rows_before: int,
          environ=os.environ) -> Optional[Witness]:
    """Start the witness of the run in ``run_dir`` (rank 0, once the run says running,
    its runs.csv holding ``rows_before`` rows of it); None where it cannot start (the run
    is then recorded as before, by rank 0 alone). The pipe's write end is not inherited
    by any process this one starts later."""
    reader, writer = os.pipe()  # both ends not inheritable (PEP 446)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [package_root, environ.get("PYTHONPATH")]))}
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "mpitrain.results.lost_run", str(run_dir), str(os.getpid()),
             str(rows_before), "resumed" if resumed else "new"],
            stdin=reader, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)  # mpirun's signals to the job's processes miss it
    except (OSError, ValueError):
        os.close(writer)
        return None
    finally:
        os.close(reader)
    _reap()
    _started.append(process)
    return Witness(process, writer)
