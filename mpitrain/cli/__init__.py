"""The entry points: the ``mpitrain`` command and ``python -m mpitrain``
(:mod:`.commands`), and how a rank leaves a run that failed (:mod:`.exits`).

:func:`main` loads the command line's modules only when called, so that
``mpitrain.cli.exits`` stays light for :mod:`mpitrain.api`."""


def main(argv=None):
    """``mpitrain ...``: see :func:`mpitrain.cli.commands.main`."""
    from .commands import main as run
    return run(argv)
