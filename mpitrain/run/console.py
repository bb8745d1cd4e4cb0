"""What the serving rank prints; other ranks get :class:`NullConsole`.

On a terminal, progress is one line redrawn in place (epoch, step, loss,
accuracy, examples/s, ETA); otherwise (a SLURM log, a pipe) it is a plain line
every ``log_every`` seconds. Errors are not printed here: ``__main__`` prints
each one once.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Iterable, Optional

from ..errors import print_line
from ..launch.dialect import launcher_of_this_process


def is_terminal(stream) -> bool:
    """Whether the user sees ``stream`` on a terminal (so redrawing a line is right).

    Open MPI gives every rank a pty for stdout, so ``isatty()`` is true even when
    mpirun's own output goes to a file, a pipe or a SLURM log. Under a launcher (any:
    see :func:`mpitrain.launch.dialect.launcher_of_this_process`) the answer is therefore
    taken from the launcher's stdout (the parent process).
    """
    if not stream.isatty():
        return False
    if not launcher_of_this_process():
        return True
    try:
        target = os.path.realpath(f"/proc/{os.getppid()}/fd/1")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty"))


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Console:
    """Rank 0's output: eval lines and progress (unless quiet), notes and summary (always)."""

    def __init__(self, quiet: bool = False, stream=None, tty: Optional[bool] = None,
                 log_every: float = 10.0, redraw_every: float = 0.25):
        self.quiet = quiet
        self.stream = stream or sys.stdout
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.log_every = log_every if not self.tty else redraw_every
        self._last_progress = float("-inf")
        self._line_open = False
        self._lock = threading.Lock()  # the async server prints from two threads
        self.accuracy: Optional[float] = None

    def info(self, message: str) -> None:
        if not self.quiet:
            self._print(message)

    def note(self, message: str) -> None:
        """Something the user must see even with --quiet (e.g. a dataset fallback)."""
        self._print("note: " + message)

    def summary(self, lines) -> None:
        for line in lines:
            self._print(line)

    def progress(self, epoch: float, epochs: int, step: int, total: int, loss: float,
                 examples_per_s: float, eta_s: float) -> None:
        """Show training progress, throttled (redrawn on a TTY, a log line otherwise)."""
        now = time.monotonic()
        if self.quiet or now - self._last_progress < self.log_every:
            return
        self._last_progress = now
        acc = f"  acc {100 * self.accuracy:.2f}%" if self.accuracy is not None else ""
        line = (f"epoch {epoch:6.2f}/{epochs}  step {step}/{total}  loss {loss:.4f}{acc}  "
                f"{examples_per_s:,.0f} ex/s  ETA {_duration(eta_s)}")
        if self.tty:
            with self._lock:
                self.stream.write("\r\033[K" + line)
                self.stream.flush()
                self._line_open = True
        else:
            self._print("progress: " + line)

    def _print(self, message: str) -> None:
        with self._lock:
            if self._line_open:  # end the redrawn progress line before a normal line
                self.stream.write("\r\033[K")
                self._line_open = False
            print_line(message, self.stream)


class NullConsole:
    """The console of ranks that must not print: same methods, no output (both are
    checked against :class:`mpitrain.train.context.ConsoleOutput` by mypy)."""

    quiet: bool = True
    accuracy: Optional[float] = None

    def info(self, message: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def summary(self, lines: Iterable[str]) -> None:
        pass

    def progress(self, epoch: float, epochs: int, step: int, total: int, loss: float,
                 examples_per_s: float, eta_s: float) -> None:
        pass
