"""Open MPI hostfiles: parse, validate, and map ranks to hosts and roles.

Format (Open MPI's): one host per line, ``HOST [slots=N] [max_slots=N]``;
``#`` starts a comment. mpirun fills each host's slots in file order (the
default ``--map-by slot``), so rank 0 -- the parameter server -- lands on the
first host, next to the first worker(s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List

from ..errors import UsageError


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    max_slots: int = 0  # 0: no hard limit given


def parse(text: str, origin: str = "hostfile") -> List[Host]:
    """The hosts in ``text``; UsageError naming the line and the reason if malformed."""
    hosts: List[Host] = []
    seen = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        values = {"slots": 1, "max_slots": 0}
        for option in options:
            key, sep, value = option.partition("=")
            key = key.replace("-", "_")
            if not sep or key not in values:
                raise UsageError(f"{origin}:{number}: cannot read {option!r}; expected "
                                 "'HOST [slots=N] [max_slots=N]'")
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
    """Parse the hostfile at ``path``; UsageError if it is missing or unreadable."""
    path = Path(path)
    try:
        return parse(path.read_text(), str(path))
    except FileNotFoundError:
        raise UsageError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"hostfile {path} cannot be read ({e})") from None


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
