"""Errors that reach the user as one line and an exit code, never as a traceback.

Every failure mpitrain expects (bad arguments, bad data, a stalled peer, replicas
that drifted apart) is one of these. ``__main__`` prints ``str(error)`` once and
exits with ``error.exit_code``; unexpected exceptions abort the whole MPI job so a
crash on one rank never becomes a hang on the others.
"""

import sys
from typing import Optional

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: A run stopped by SIGTERM/SIGINT after saving its state (128 + SIGTERM, the shell convention).
EXIT_INTERRUPTED = 143
#: Results could not be written (a full or read-only disk: sysexits' EX_IOERR): a restart
#: would fail the same way, so ``mpitrain launch`` does not restart it.
EXIT_CANNOT_WRITE = 74


class MpitrainError(Exception):
    """A failure with a message meant for the user: what went wrong and how to fix it.

    ``everywhere`` is True when every rank raises the same error at the same point
    (usage errors, and errors agreed on collectively): then each rank can exit on
    its own and rank 0 alone prints it. Otherwise the raising rank prints it and
    aborts the job, so the other ranks are not left waiting for it. ``summary``: what
    the run had made when it ended so (a :class:`mpitrain.train.Summary`), for its
    records; None if nothing. ``reporter``: where several ranks raise it, the one that
    prints it for the job (None: rank 0 for an error raised everywhere, else this rank).
    """

    exit_code = EXIT_FAILURE
    everywhere = False
    reporter: Optional[int] = None

    def __init__(self, message: str = "", everywhere: Optional[bool] = None, summary=None):
        super().__init__(message)
        if everywhere is not None:
            self.everywhere = everywhere
        self.summary = summary


class UsageError(MpitrainError):
    """Bad command-line arguments or a configuration that cannot run (exit code 2).

    Raised identically on every rank (it depends only on the arguments and the
    world size), so each rank can exit on its own without talking to the others.
    """

    exit_code = EXIT_USAGE
    everywhere = True


class DataError(MpitrainError):
    """A dataset that is missing, unreadable, truncated or malformed."""


class CommTimeout(MpitrainError):
    """A bounded wait on other ranks ran out of time (a stalled or dead peer)."""


class RanksLost(CommTimeout):
    """A wait of this communicator cannot complete: ranks of it died (``lost``: their
    ranks in it, as far as this rank can see: its host's processes and what MPI
    reported). ``decided``: the ranks that go on, where rank 0 already said so (the
    start-up's regroup, :mod:`mpitrain.comm.regroup`); else None."""

    def __init__(self, message: str, lost=(), decided=None, **kwargs):
        super().__init__(message, **kwargs)
        self.lost = sorted(lost)
        self.decided = decided


class ReplicaDrift(MpitrainError):
    """Sync replicas that must hold identical weights do not."""


class Divergence(MpitrainError):
    """A NaN or Inf appeared in a loss or a gradient."""


class ResultsError(MpitrainError):
    """A results directory or file that cannot be written or read as expected."""


class WriteError(ResultsError):
    """A result that cannot be written (no space left, a read-only file system, no
    permission): the run is recorded as failed where there is room, files already
    written stay intact, and it is not restartable (exit code 74)."""

    exit_code = EXIT_CANNOT_WRITE


class PeerFailure(MpitrainError):
    """Another rank failed and told rank 0 why (its message is this error's)."""


class Interrupted(MpitrainError):
    """The run was stopped by a signal after saving what it had."""

    exit_code = EXIT_INTERRUPTED


class Dropped(MpitrainError):
    """This async worker was dropped by the server (it stalled past its liveness bound
    under ``--enable-recovery``); the run went on without it, so it leaves quietly."""

    exit_code = 0


def print_line(text: str, stream=None) -> None:
    """Write ``text`` and its newline in one write, flushed (to stderr by default).
    ``print`` writes them apart, and where each write is a system call of its own
    (``PYTHONUNBUFFERED=1``, common under mpirun) two ranks' lines can interleave into
    one line of the job's output."""
    stream = sys.stderr if stream is None else stream
    stream.write(text + "\n")
    stream.flush()
