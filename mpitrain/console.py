"""What the serving rank prints; other ranks get :class:`NullConsole`.

Errors are not printed here: ``__main__`` prints each one once.
"""

from __future__ import annotations

import sys


class Console:
    """Rank 0's output: progress lines (unless quiet), notes and the summary (always)."""

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stdout

    def info(self, message: str) -> None:
        if not self.quiet:
            self._print(message)

    def note(self, message: str) -> None:
        """Something the user must see even with --quiet (e.g. a dataset fallback)."""
        self._print("note: " + message)

    def summary(self, lines) -> None:
        for line in lines:
            self._print(line)

    def _print(self, message: str) -> None:
        print(message, file=self.stream, flush=True)


class NullConsole:
    """The console of ranks that must not print: same methods, no output."""

    quiet = True

    def info(self, message):
        pass

    def note(self, message):
        pass

    def summary(self, lines):
        pass
