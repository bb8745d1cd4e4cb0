"""Files that are whole or absent: the one way mpitrain replaces a file.

The content goes to a hidden temporary file beside the target (``.<name>.tmp``),
is flushed and fsynced, and is then renamed over the target. A reader (another
rank, a resumed run, ``mpitrain report``, a resumed sweep) sees the old file or
the new one, never part of one; a writer that fails removes its temporary file
and leaves the target as it was; a writer killed mid-write leaves at most the
temporary file, which the next write of the same target replaces.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_file(path, mode: str = "w", tmp_suffix: str = ".tmp", durable: bool = True,
                **open_kwargs) -> Iterator[IO]:
    """Write ``path`` atomically: yields a file open at ``.<name><tmp_suffix>`` beside it.

    When the block ends normally the file is flushed, fsynced and renamed over
    ``path``; when it raises, the temporary file is removed and ``path`` is left
    untouched. Writers that may race for the same target (several ranks of one
    host) give a ``tmp_suffix`` of their own, e.g. with their pid. ``durable=False``
    skips the fsync, for a file the next write soon replaces: readers still see the
    old file or the new one; only a crash of the machine itself may lose the new one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{tmp_suffix}")
    tmp.unlink(missing_ok=True)  # a leftover of a killed writer, or anything in its place
    try:
        with open(tmp, mode.replace("w", "x"), **open_kwargs) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only still there if something failed


def write_json_atomic(path, obj, durable: bool = True) -> None:
    """Write ``obj`` as JSON (indented, keys sorted, one final newline) to ``path``
    atomically (``durable``: see :func:`atomic_file`)."""
    with atomic_file(path, durable=durable) as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def write_text_atomic(path, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_file(path, encoding=encoding) as f:
        f.write(text)
