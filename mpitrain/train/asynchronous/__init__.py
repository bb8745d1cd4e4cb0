"""Asynchronous parameter-server training (``--async``), with bounded staleness.

Rank 0 (the server) holds the canonical weights as one flat float32 vector and
applies each worker's gradient the moment it arrives, in arrival order, with a
numpy/C optimizer; it never runs TensorFlow in its protocol loop, so it needs
microseconds per update and sleeps in between (see :class:`mpitrain.comm.Backoff`).
Evaluation runs in a background thread on a snapshot of the weights, so it never
stalls the workers.

Protocol, per worker (all messages on the world communicator, numpy buffers with
the header of :mod:`..protocol` in front, mpi4py uppercase methods):

1. The worker waits for a **lease**: the server's reply ``[header | weights]`` on
   ``TAG_WEIGHTS``; the header carries the weights' version (the server's update
   count when they were sent).
2. It computes the gradient of its next batch at those weights (one compiled call)
   and pushes ``[header | gradient]`` on ``TAG_GRADIENT``; the header carries the
   version the gradient was computed at, the step, the loss, and FINAL on its last
   batch. The receive of the reply is started before the push.
3. The server applies the gradient (staleness = server version - that version,
   recorded per worker), replies with a new lease when the staleness bound allows
   (at once when unbounded), and starts its receive for that worker again. A FINAL
   push gets a header-only reply and ends that worker.

Bounded staleness (``--staleness K``): the server grants a lease only while every
lease holder would still see its gradient applied with staleness <= K
(:class:`..leases.Leases`); K = 0 is synchronous training one worker at a time, no
K (the default) never holds anyone.

A worker waits at most twice ``--timeout`` for a reply (the server speaks first
about a stalled peer). Under ``mpirun --enable-recovery`` (which keeps the other
ranks alive when one dies) a worker on the server's host stops within a second of
the server's process dying, so ``mpitrain launch`` restarts the run then, not after
the worker's reply bound; lost workers: :mod:`.recovery`.

The rooms:

* :mod:`.mailbox`: the message buffers of a worker and its server, and how they
  travel (whole through MPI, or in memory both map with only headers through MPI);
* :mod:`.pool`: the server's side of them pooled above a memory budget (its memory
  flat in the number of workers);
* :mod:`.worker`: the worker loop;
* :mod:`.server`: the server loop: applies pushes, grants leases, dismisses;
* :mod:`.store`: the parameters the server owns, their optimizer and version;
* :mod:`.accounts`: what the server counts per worker, in checkpoints and results;
* :mod:`.recovery`: lost workers (``--enable-recovery``): found, dropped, fenced;
* :mod:`.worker_states`: a worker's life, one state machine both loops follow.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ...comm import PeerProcesses, Role, recovery_enabled
from ...errors import CommTimeout
from ..context import Context, Summary
from ..evaluation import Stopwatch
from .mailbox import PIPELINE_DEPTH, Mailbox, ServerEnd
from .sharded.partition_server import PartitionServer
from .server import Server
from .worker import work

#: seconds a worker that saw the server die leaves the report to the one worker that
#: speaks, whose abort of the job (a few seconds) ends this one too (see _one_voice)
SPEAKER_GRACE = 20.0


def train(ctx: Context) -> Summary:
    """Run async training on this rank. Collective: every rank of the world calls it."""
    clock = Stopwatch()
    if ctx.role is Role.SERVER:
        server = Server(ctx, clock)
        ctx.started()
        return server.run()
    comm, servers = ctx.comm, [s for s in range(ctx.cfg.asynchronous.servers) if s != ctx.comm.rank]
    # under --enable-recovery a server's death does not end the job: a rank on its host
    # sees it directly and stops, instead of waiting out its reply bound
    peers = PeerProcesses(comm) if recovery_enabled() else None
    comm.while_waiting = _watch(peers, servers) if peers else None
    try:
        if ctx.role is Role.PARTITION:
            partition = PartitionServer(ctx, clock)
            ctx.started()
            return partition.run()
        return work(ctx, clock)
    except CommTimeout:
        # (watched only with peers, under recovery, when a server shares this host)
        if peers is not None and comm.while_waiting:
            dead = [s for s in servers if not peers.alive(s)]
            if dead:
                _one_voice(comm, peers, dead[0])
        raise
    finally:
        comm.while_waiting = None


def _watch(peers: PeerProcesses, servers) -> Optional[Callable[[], None]]:
    """A check for :attr:`Comm.while_waiting` that raises once one of the parameter
    ``servers`` on this host has died; None when none runs here."""
    watches = [peers.watch(s, "the parameter server" if s == 0 else
                           "a parameter server (of a share of the parameters)")
               for s in servers]
    checks = [check for check in watches if check is not None]
    if len(checks) < 2:
        return checks[0] if checks else None

    def check() -> None:
        for each in checks:
            each()
    return check


def _one_voice(comm, peers: PeerProcesses, server: int) -> None:
    """A server died, and every rank on its host saw it at once: one of them says so,
    the lowest-ranked still alive (its line ends the job); the others give it
    SPEAKER_GRACE to do that, and say it themselves only if it did not."""
    alive = [r for r in comm.ranks_on_host(comm.hosts[server])
             if r != server and (r == comm.rank or peers.alive(r))]
    if comm.rank != min(alive):
        time.sleep(SPEAKER_GRACE)


__all__ = ["train", "Server", "Mailbox", "ServerEnd", "PIPELINE_DEPTH"]
