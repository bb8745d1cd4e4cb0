"""``python -m mpitrain``: see :mod:`mpitrain.cli`."""

import sys

from .cli import main

sys.exit(main())
