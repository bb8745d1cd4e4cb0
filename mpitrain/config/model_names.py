"""How models are named: a registered name (``lr``) or a user's spec, ``FILE.py:FUNCTION``
or ``package.module:FUNCTION``. Pure string and path functions (a leaf: the tools, the
checkpoint's resume and the CLI name models without importing any).
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def is_spec(name: str) -> bool:
    """True for ``FILE.py:FUNCTION`` / ``module:FUNCTION`` (a user's model), not a name.

    A bare ``FILE.py`` or path counts too, so that it gets the error saying to add
    ``:FUNCTION`` rather than "invalid choice"."""
    return (":" in name or name.endswith(".py") or "/" in name) and not name.startswith("-")


def split(spec: str):
    """(target, function) of a spec; function is '' when the spec names none."""
    target, colon, function = spec.rpartition(":")
    return (target, function) if colon else (spec, "")


def same_model(given: str, saved: str) -> bool:
    """Whether ``given`` (a resumed run's command line) names the run's ``saved`` model:
    equal names, or user specs of the same file name and function (the saved, absolute
    path is what is loaded, so resuming from another directory works)."""
    if given == saved or not (is_spec(given) and is_spec(saved)):
        return given == saved
    return run_name(given) == run_name(saved)


def canonical(name: str) -> str:
    """A spec with its file made absolute (a resumed run finds it from anywhere)."""
    if not is_spec(name):
        return name
    target, function = split(name)
    if is_file(target):
        target = str(Path(target).expanduser().resolve())
    return f"{target}:{function}" if function else target


def run_name(name: str) -> str:
    """A file-name-safe label for run directories: ``lr``, ``my_model-build``."""
    if not is_spec(name):
        return name
    target, function = split(name)
    stem = Path(target).stem if is_file(target) else target
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{stem}-{function}" if function else stem)


def is_file(target: str) -> bool:
    """Whether a spec's target is a file (``.py``, or a path) rather than a module."""
    return target.endswith(".py") or os.sep in target or "/" in target
