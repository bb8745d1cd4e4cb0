"""Hostfiles: parse, validate, write in a launcher's format, and map ranks to hosts and roles.

Two formats, one host per line, ``#`` starting a comment: Open MPI's ``HOST [slots=N]
[max_slots=N]`` and MPICH Hydra's ``HOST[:N]``. Each launcher reads only its own
(Hydra takes ``slots=4`` for a host name; Open MPI refuses ``host:4``), so mpitrain
reads both and hands mpirun the file in its own (:func:`for_launcher`). mpirun fills
each host's slots in file order (Open MPI's default ``--map-by slot``, Hydra's too),
so rank 0 -- the parameter server -- lands on the first host, next to the first
worker(s).
"""

from __future__ import annotations

import atexit
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .dialect import COLON, SLOTS
from ..errors import UsageError
from ..userfiles import read_bounded


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    max_slots: int = 0  # 0: no hard limit given


def parse(text: str, origin: str = "hostfile") -> List[Host]:
    """The hosts in ``text`` (either format); UsageError naming the line and the reason
    if malformed."""
    hosts: List[Host] = []
    seen = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        values = {"slots": 1, "max_slots": 0}
        if ":" in name:  # Hydra's HOST:N
            name, _, count = name.partition(":")
            if options:
                raise UsageError(f"{origin}:{number}: {line!r} mixes MPICH's 'HOST:N' with "
                                 "Open MPI's options; write 'HOST slots=N' or 'HOST:N'")
            if not name or not count.isdigit() or int(count) < 1:
                raise UsageError(f"{origin}:{number}: cannot read {line!r}; expected "
                                 "'HOST:N' with N a positive integer")
            values["slots"] = int(count)
        for option in options:
            key, sep, value = option.partition("=")
            key = key.replace("-", "_")
            if not sep or key not in values:
                raise UsageError(f"{origin}:{number}: cannot read {option!r}; expected "
                                 "'HOST [slots=N] [max_slots=N]' or 'HOST:N'")
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"{origin}:{number}: {key} must be a positive integer "
                                 f"(got {value!r})")
            values[key] = int(value)
        if name in seen:
            raise UsageError(f"{origin}:{number}: host {name} is listed twice")
        if values["max_slots"] and values["max_slots"] < values["slots"]:
            raise UsageError(f"{origin}:{number}: max_slots is smaller than slots")
        seen.add(name)
        hosts.append(Host(name, values["slots"], values["max_slots"]))
    if not hosts:
        raise UsageError(f"{origin}: no hosts listed")
    return hosts


def read(path) -> List[Host]:
    """Parse the hostfile at ``path``; UsageError if it is missing, unreadable or no
    regular file."""
    return parse(_text(path), str(path))


def _text(path) -> str:
    """The hostfile's text, read with a bound from a regular file only (a FIFO given as
    the hostfile would block the read forever): else one UsageError naming it."""
    try:
        return read_bounded(path, error=lambda message: UsageError(f"hostfile {message}")
                            ).decode()
    except FileNotFoundError:
        raise UsageError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"hostfile {path} cannot be read ({e})") from None


def format_of(text: str) -> Optional[str]:
    """The format ``text`` is written in (SLOTS or COLON), None when either launcher
    reads it (bare host names)."""
    lines = [raw.split("#", 1)[0].strip() for raw in text.splitlines()]
    if any(":" in line.split()[0] for line in lines if line):
        return COLON
    if any(len(line.split()) > 1 for line in lines if line):
        return SLOTS
    return None


def render(hosts: List[Host], fmt: str) -> str:
    """``hosts`` as a hostfile in ``fmt`` (SLOTS or COLON; COLON has no max_slots)."""
    if fmt == COLON:
        return "".join(f"{h.name}:{h.slots}\n" for h in hosts)
    return "".join(f"{h.name} slots={h.slots}" + (f" max_slots={h.max_slots}" if h.max_slots
                                                  else "") + "\n" for h in hosts)


def for_launcher(path: str, fmt: str) -> str:
    """A hostfile with ``path``'s hosts that a launcher reading ``fmt`` understands:
    ``path`` itself when it is in that format already, else a copy written in it (a
    temporary file that lives as long as the process)."""
    text = _text(path)
    if format_of(text) in (None, fmt):
        return path
    if (path, fmt, text) not in _CONVERTED:  # (one copy however often a job restarts)
        out = tempfile.NamedTemporaryFile("w", prefix="mpitrain-hostfile-", delete=False)
        with out:
            out.write(render(parse(text, path), fmt))
        _CONVERTED[(path, fmt, text)] = out.name
    return _CONVERTED[(path, fmt, text)]


_CONVERTED: Dict[Tuple[str, str, str], str] = {}


@atexit.register
def _remove_temporary() -> None:
    for name in _CONVERTED.values():
        try:
            Path(name).unlink()
        except OSError:
            pass


def total_slots(hosts: List[Host]) -> int:
    return sum(h.slots for h in hosts)


def placement(hosts: List[Host], np_: int) -> List[str]:
    """Host of each rank under mpirun's default by-slot mapping (no oversubscription)."""
    if np_ > total_slots(hosts):
        raise UsageError(f"-np {np_} needs {np_} slots but the hostfile offers "
                         f"{total_slots(hosts)}; lower -np, add slots, or pass "
                         "--oversubscribe to mpirun")
    ranks: List[str] = []
    for host in hosts:
        ranks.extend([host.name] * host.slots)
    return ranks[:np_]
