"""``python -m mpitrain``: see :mod:`mpitrain.cli`; the process ends through
:func:`mpitrain.exits.leave`."""

from .cli import main
from .exits import leave

leave(main())
