"""How a rank leaves a run that failed: the CLI's and ``mpitrain.fit``'s one way.

An error every rank raised together is printed once, by rank 0, which carries the exit
code; an error only this rank knows is reported to rank 0 (which records the run as
failed) and ends the whole job, so that no rank is left waiting for this one; a crash
(an internal error) prints its traceback and ends the job at once. A process whose
training is over leaves without the interpreter's teardown (:func:`leave`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import NoReturn

from ..comm import (abort_world, open_mpi_4_recovery, report_failure, world_rank_if_running,
                    world_size_if_running)
from ..errors import EXIT_FAILURE, Dropped, Interrupted, MpitrainError, print_line

PROG = "mpitrain"


def report(error: MpitrainError) -> int:
    """Print ``error`` once and return its exit code, or end the job if it is local.

    An error every rank raised together is printed by rank 0, which carries the
    exit code. An error only this rank knows is, on a worker, first reported to
    rank 0 (which records the run as failed, prints it and aborts the job); on
    rank 0, printed and followed by an abort of the whole job. A worker the async
    server dropped (:class:`~mpitrain.errors.Dropped`) says so and leaves quietly.
    """
    rank = world_rank_if_running()
    if isinstance(error, Dropped):  # the run goes on without this rank: leave quietly
        print_line(f"{PROG}: {error}")
        return error.exit_code
    label = "interrupted" if isinstance(error, Interrupted) else "error"
    if error.everywhere or world_size_if_running() <= 1:
        if rank != 0:
            # If every rank exited non-zero at once, mpirun would tear the job down
            # on the first exit and could drop rank 0's line.
            return 0
        print_line(f"{PROG}: {label}: {error}")
        if error.exit_code and open_mpi_4_recovery():
            abort_world(error.exit_code)  # so that its mpirun exits 1, not 0 (see there)
        return error.exit_code
    if rank != 0:
        report_failure(str(error))  # returns only if rank 0 did not end the job
    print_line(f"{PROG}: {label}: {error}")
    abort_world(error.exit_code)
    return error.exit_code


def crash() -> int:
    """For the exception being handled, one that is no MpitrainError: its traceback,
    named by rank, then the whole job ended (a crash on one rank must not leave the
    others waiting)."""
    sys.stderr.write(f"{PROG}: internal error on rank {world_rank_if_running()}:\n")
    traceback.print_exc()
    abort_world(EXIT_FAILURE)
    return EXIT_FAILURE


def leave(code: int) -> NoReturn:
    """End the process with ``code`` once its runs are over (``python -m mpitrain``'s
    last step). Where TensorFlow was loaded, the exit handlers run (MPI's bounded
    finalize, logging's flush), stdout and stderr are flushed, and the process ends
    without the interpreter's teardown: freeing TensorFlow's modules and objects one by
    one costs a rank most of a second of CPU after its run is over, and the ranks of
    one host pay it together, so the time from a run's end to mpirun's exit grew with
    the ranks per host (against the launcher's fixed grace, ``TEARDOWN_GRACE``). The
    ordinary exit otherwise, and while a thread that is not a daemon still runs (the
    interpreter would wait for it)."""
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if "tensorflow" not in sys.modules or others:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or replaced by None
            pass
    os._exit(code)
