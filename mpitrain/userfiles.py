"""Opening the files a user names (data, model files, run directories): regular files
only, and small ones read with a bound.

A name can stand for something that is not a file. Reading a FIFO blocks until some
process writes to it, forever if none does; a character device (``/dev/zero``,
``/dev/urandom``) never ends; a directory cannot be read as a file. Every reader of
the user's files opens them here: :func:`open_regular` opens without blocking
(``O_NONBLOCK``, which a FIFO's open needs) and looks at what it opened
(``fstat``: no race between a check and the open) before anything is read, so such a
name is one error line naming it and what it is, never a hang. Files read whole as
text (JSON, a model's source, a sweep spec) are read with :func:`read_bounded`, which
refuses one larger than its bound instead of reading without end.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO, Callable, Optional

#: what the small text files mpitrain reads whole (config.json, status.json, a
#: model's source, a sweep spec) may weigh at most
TEXT_LIMIT = 16 * 2**20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``a FIFO (named pipe)``)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path, mode: int) -> str:
    """The message for ``path``, which is no regular file."""
    return (f"{path}: is {kind_of(mode)}, not a regular file; mpitrain reads only regular "
            "files: replace or remove it")


class NotRegular(OSError):
    """``path`` is no regular file but ``kind`` (``a FIFO (named pipe)``...)."""

    def __init__(self, path, mode: int):
        self.path, self.kind = path, kind_of(mode)
        super().__init__(not_regular(path, mode))


def open_regular(path, error: Optional[Callable[[str], Exception]] = None) -> BinaryIO:
    """``path`` open for reading in binary, if it is a regular file (after symlinks);
    otherwise ``error`` (taking the message: an exception class, say) naming it and
    what it is, by default :class:`NotRegular`. Never blocks: a FIFO is opened without
    waiting for a writer, seen for what it is and closed. A missing file raises
    FileNotFoundError as ``open`` does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(not_regular(path, mode)) if error else NotRegular(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path, limit: int = TEXT_LIMIT,
                 error: Optional[Callable[[str], Exception]] = None) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`); ``error``
    (default OSError) if it holds more than ``limit`` bytes (also one that grows while
    it is read)."""
    with open_regular(path, error) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise (error or OSError)(f"{path}: larger than {limit // 2**20} MiB, too large "
                                 "for this file (is it the right one?)")
    return data


def is_regular(path) -> bool:
    """True if ``path`` names a regular file (after symlinks); never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def stat_mode(path) -> int:
    """``path``'s st_mode after symlinks, 0 if there is nothing there."""
    try:
        return os.stat(Path(path)).st_mode
    except (OSError, ValueError):
        return 0


def read_json_object(path: Path) -> Optional[dict]:
    """The JSON object in ``path`` (status.json, config.json), or None when there is none
    to read (missing, unreadable, no regular file, not JSON, not an object): the run has
    not said it yet. Never blocks (a FIFO in its place is no object)."""
    try:
        status = json.loads(read_bounded(path))
    except (OSError, ValueError):  # ValueError: bad JSON, or bytes that are not UTF-8
        return None
    return status if isinstance(status, dict) else None
