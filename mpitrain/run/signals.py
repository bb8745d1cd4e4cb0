"""Stopping a run on a signal.

:class:`StopRequest`: SIGTERM, SIGINT and SIGUSR1 set a flag that the training loops
read every step; the protocols make all ranks agree on the step at which they stop,
rank 0 saves a checkpoint and the results so far, and the job exits with code 143
(interrupted). SIGTERM is what SLURM sends at the time limit and on ``scancel``;
mpirun forwards SIGTERM/SIGINT to the ranks but SIGKILLs them about a second later,
while it forwards SIGUSR1 and then waits, so ``kill -USR1 <mpirun pid>`` is the way to
stop a large model gracefully (the SLURM scripts in jobs/ do that).
"""

from __future__ import annotations

import signal
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Set by a stop signal; read by the training loops (cheap: one attribute).

    A second signal of the same kind restores the default action, so a user
    pressing Ctrl-C twice is not held hostage by a slow save.
    """

    def __init__(self):
        self.signum: Optional[int] = None

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
        self.signum = signum

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop from code (a peer told us, or a test)."""
        if self.signum is None:
            self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""
