"""What a value of a setting may be, and how one setting is declared.

A setting is a field of :class:`mpitrain.config.Config` or of one of its sections,
declared with :func:`option`: its help text, its flag, its argparse keywords, the
values it accepts (:class:`Number` for the numeric ones, ``choices`` for the others)
and its key, the flat name the command line, ``mpitrain.fit`` and config.json know it
by. :func:`checked_value` is the one check of a value, whoever gives it. A leaf.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Optional

from ..errors import UsageError

#: the largest count a setting may hold (epochs, steps, batch...): steps travel in int32
MAX_COUNT = 2**31 - 1
#: the longest time a setting may give (--timeout...): past it a wait is no bound at all,
#: and twice it still fits the millisecond timeouts (int32) of poll(2) and MPI's waits
MAX_SECONDS = 1_000_000.0


@dataclass(frozen=True)
class Number:
    """The values a numeric setting accepts: finite, from ``low`` to ``high`` (``low``
    itself excluded with ``above_low``), whole where ``integral``; and ``off``, one more
    value that means off or auto (0 for --threads, --sample-interval)."""

    integral: bool
    low: float
    high: float = MAX_COUNT
    above_low: bool = False
    off: Optional[float] = None
    unit: str = ""
    off_means: str = "off"

    def normalized(self, value, label: str):
        """``value`` as an int or float if it is acceptable; UsageError naming ``label``."""
        number = _as_number(value, self.integral)
        if number is not None and (number == self.off or self._in_range(number)):
            return number
        raise UsageError(f"{label} must be {self.describe(value)} (got {value!r})")

    def _in_range(self, number) -> bool:
        above = number > self.low if self.above_low else number >= self.low
        return above and number <= self.high

    def describe(self, value=None) -> str:
        """What the setting accepts, in words; the upper bound too where it is not the
        largest count, or where ``value`` passes it."""
        unit = f" {self.unit}" if self.unit else ""
        kind = "integer" if self.integral else "number"
        if self.low == 0 and self.above_low or self.low == 1 and self.integral:
            what = f"a positive {kind}{unit}"
        elif self.low == 0:
            what = f"0 or a positive {kind}{unit}"
        else:
            what = f"{'an' if self.integral else 'a'} {kind}{unit} of at least {_shown(self.low)}"
        if self.off is not None:
            what = f"{_shown(self.off)} ({self.off_means}) or {what}"
        beyond = isinstance(value, numbers.Real) and not value <= self.high  # inf, NaN too
        if math.isfinite(self.high) and (self.high < MAX_COUNT or beyond):
            what += f", at most {_shown(self.high)}"
        return what


#: integers from 1 (counts: epochs, steps, batch...)
COUNT = Number(True, 1)
#: a positive number of seconds, a real bound
SECONDS = Number(False, 0, MAX_SECONDS, above_low=True, unit="of seconds")


def _shown(bound: float) -> str:
    return f"{int(bound):,}" if float(bound).is_integer() else f"{bound:g}"


def _as_number(value, integral: bool):
    """``value`` as a builtin int (``integral``: an integer, or a float with no fraction)
    or float, or None when it is no finite number (a string, a bool, None, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral) and integral:
        return int(value)
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return None
    if isinstance(value, numbers.Integral) and number != value:
        return None  # an int a float cannot hold exactly: taken, it would not be the value given
    value = number
    if not math.isfinite(value):
        return None
    if integral:
        return int(value) if value.is_integer() else None
    return value


def option(doc: str, default=None, *, flag: Optional[str] = None, key: Optional[str] = None,
           number: Optional[Number] = None, accepts: tuple = (), **cli):
    """A setting's field: its help text (``doc``), its command-line ``flag`` (None: no
    option), its ``key`` (the flat name; default: the field's own name), ``cli``'s extra
    argparse keywords; ``number``: the values a numeric setting accepts; ``accepts``:
    the words a numeric setting also takes (--staleness auto; with none, Python's None
    means it too), or the values a setting with ``choices`` also takes besides them
    (filled in by :func:`mpitrain.config.resolve`, never typed)."""
    return field(default=default, metadata={"doc": doc, "flag": flag, "key": key, "cli": cli,
                                            "number": number, "accepts": accepts})


@dataclass(frozen=True)
class Setting:
    """One setting as the command line, ``mpitrain.fit`` and config.json see it: its
    ``key`` and where it lives (``section``, an attribute of Config, '' for the run's
    own settings; ``name``, its field there)."""

    key: str
    section: str
    name: str
    field: dataclasses.Field

    @classmethod
    def of(cls, f: dataclasses.Field, section: str = "") -> "Setting":
        return cls(f.metadata.get("key") or f.name, section, f.name, f)

    @property
    def flag(self) -> Optional[str]:
        return self.field.metadata.get("flag")

    @property
    def doc(self) -> str:
        return self.field.metadata["doc"]

    @property
    def cli(self) -> dict:
        return self.field.metadata["cli"]

    @property
    def number(self) -> Optional[Number]:
        return self.field.metadata.get("number")

    @property
    def default(self):
        return self.field.default

    @property
    def label(self) -> str:
        """How messages name it: its flag (``--epochs``), else its key in words."""
        return self.flag or self.key.replace("_", " ")


def checked_value(setting: Setting, value, label: str):
    """``value`` of ``setting`` as a plain int, float, bool or str, if it is one the
    setting accepts (see :class:`Number`, its choices); UsageError naming ``label``."""
    meta = setting.field.metadata
    if setting.number:
        # (a setting that takes the word none takes Python's None for it too)
        if isinstance(value, str) and value in meta["accepts"] or \
                value is None and "none" in meta["accepts"]:
            return value
        try:
            return setting.number.normalized(value, label)
        except UsageError:
            if not meta["accepts"]:
                raise
            raise UsageError(f"{label} must be {', '.join(meta['accepts'])}, or "
                             f"{setting.number.describe(value)} (got {value!r})") from None
    choices = setting.cli.get("choices")
    if choices:
        if isinstance(value, str) and value in choices + meta["accepts"]:
            return value
        raise UsageError(f"{label} must be one of {', '.join(choices)} (got {value!r})")
    if setting.cli.get("action") == "store_true":
        if isinstance(value, bool):
            return value
        raise UsageError(f"{label} is a switch: true or false (got {value!r})")
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise UsageError(f"{label} must be a non-empty path or name (got {value!r})")
