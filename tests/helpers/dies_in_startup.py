"""``python -m mpitrain ARGS`` on every rank, except that rank RANK kills itself (SIGKILL)
when the job's start-up reaches WHERE, for the start-up-loss tests (test_recovery.py,
test_mpis.py):

    mpirun ... python tests/helpers/dies_in_startup.py WHERE RANK ARGS...

WHERE: ``data`` (as it loads its data: before rank 0 opens the run directory) or
``mailboxes`` (as the async trainer makes its message buffers: the run directory is
open, the trainer's own start-up under way). A kill from outside could not land there
reliably: a rank passes each phase in well under a second.
"""

import os
import signal
import sys

where, victim, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK")
           or os.environ.get("PMI_RANK") or 0)


def die(module, name):
    """Replace ``module.name`` by a function that kills this process first."""
    real = getattr(module, name)

    def dying(*a, **kw):
        os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)

    setattr(module, name, dying)


if rank == victim:
    if where == "data":
        from mpitrain.run import session
        die(session, "load_data")
    elif where == "mailboxes":
        from mpitrain.train.asynchronous import mailbox
        die(mailbox, "share_mailboxes")
    else:
        sys.exit(f"dies_in_startup.py: WHERE is data or mailboxes, not {where!r}")

from mpitrain.cli.commands import main  # noqa: E402
from mpitrain.cli.exits import leave  # noqa: E402

leave(main(args))
