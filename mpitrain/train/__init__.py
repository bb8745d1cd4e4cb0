"""The two training protocols and what they share.

* :mod:`.context`: the run's :class:`Context` and :class:`Summary`, worker batches,
  evaluation and checkpoint points, the errors that stop every rank;
* :mod:`.protocol`: tags, the message header and its flags, the health sentinel,
  the silent-peer watchdog, the phase timer;
* :mod:`.sync`: sync training, one fused allreduce per step among the workers;
* :mod:`.asynchronous`: async training, a parameter server applying pushes as
  they arrive;
* :mod:`.leases`: the async server's pure policies (staleness leases, liveness,
  step quotas);
* :mod:`.evaluation`: the serving rank's evaluation, curve and clock.

Each protocol is a function ``train(ctx) -> Summary`` that every rank calls
(:func:`trainer` picks it); it receives a communicator in ``ctx.comm`` and never
imports MPI itself.
"""

from __future__ import annotations

from .context import Context, Summary, lr_schedule


def trainer(async_mode: bool):
    """The ``train(ctx)`` function of the async or the sync protocol."""
    from . import asynchronous, sync

    return asynchronous.train if async_mode else sync.train


__all__ = ["Context", "Summary", "lr_schedule", "trainer"]
