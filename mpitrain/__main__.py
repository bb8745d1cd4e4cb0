"""``python -m mpitrain``: see :mod:`mpitrain.cli.commands`; the process ends through
:func:`mpitrain.cli.exits.leave`."""

from .cli.commands import main
from .cli.exits import leave

leave(main())
