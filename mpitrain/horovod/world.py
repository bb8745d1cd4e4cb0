"""The process's state under ``mpitrain.horovod``: init and shutdown, who the ranks are,
and how a failure ends the job.

``init`` brings up MPI through :class:`mpitrain.comm.Comm` (every wait bounded by
``timeout``), widens the rank's CPU affinity and gives TensorFlow its share of the
host's cores, as the CLI does, and makes the collectives' :class:`~.collectives.Collectives`.
Unlike Horovod there is no background thread: a collective runs in the thread that
calls it (inside ``tf.function``, TensorFlow's) and returns when its data has moved.

Failures end the job instead of hanging it. Importing this package installs a
``sys.excepthook``: an mpitrain error that every rank raised together (a call before
``init``, ranks that disagree about a collective) is printed once, by rank 0, as one
line, and every rank exits non-zero; an error only one rank knows (a stalled peer,
an exception of the script's own on one rank) is printed by that rank and ends the
whole job (``MPI_Abort``), so no rank is left waiting for it.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional

from ..errors import EXIT_FAILURE, EXIT_INTERRUPTED, MpitrainError, UsageError, print_line

#: seconds any rank waits for another in a collective before the job ends, naming it
DEFAULT_TIMEOUT = 300.0
#: environment variables that set init's options without changing the script
TIMEOUT_ENV, RESULTS_ENV = "MPITRAIN_TIMEOUT", "MPITRAIN_RESULTS_DIR"
#: seconds a rank that timed out waits for the rank that reports the same wait to end
#: the job, before it prints and ends it itself: the ranks reached the call at times
#: that differ by about a step
REPORTER_GRACE = 30.0


class NotInitialized(UsageError, ValueError):
    """A call that needs ``hvd.init()`` came before it (a ValueError, as Horovod's)."""


class Unsupported(UsageError, NotImplementedError):
    """A Horovod feature mpitrain.horovod does not provide; the message names what to use."""


def unsupported(feature: str, instead: str) -> Unsupported:
    return Unsupported(f"mpitrain.horovod does not provide {feature}: {instead}")


@dataclass
class Topology:
    """Where this rank sits: its host's ranks (local) and its peers of the same local
    rank on the other hosts (cross), as Horovod numbers them."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool

    @classmethod
    def of(cls, hosts: List[str], rank: int) -> "Topology":
        local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        local_rank_of = [sum(1 for h in hosts[:r] if h == hosts[r]) for r in range(len(hosts))]
        cross = [r for r in range(len(hosts)) if local_rank_of[r] == local_rank_of[rank]]
        per_host = {h: hosts.count(h) for h in hosts}
        return cls(rank, len(hosts), local.index(rank), len(local), cross.index(rank),
                   len(cross), len(set(per_host.values())) == 1)


class _State:
    comm: Any = None  # mpitrain.comm.Comm, once initialised
    engine: Any = None  # .collectives.Collectives
    topology: Optional[Topology] = None
    telemetry: Any = None  # .telemetry.Telemetry, with a results directory
    #: the last error a collective raised (inside tf.function TensorFlow wraps it)
    last_error: Optional[MpitrainError] = None


STATE = _State()


def init(comm=None, process_sets=None, *, timeout: Optional[float] = None,
         results_dir: Optional[str] = None, threads: Optional[int] = None,
         keep_cpu_binding: bool = False, start_timeout: Optional[float] = None) -> None:
    """Start mpitrain.horovod on every rank of the job (``mpirun -np N python script.py``).

    Collective: every rank calls it. A second call is a no-op (as Horovod's).
    ``timeout`` (default ``$MPITRAIN_TIMEOUT`` or 300 s): how long any rank waits for
    the others in a collective before the job ends with the late rank named.
    ``results_dir`` (default ``$MPITRAIN_RESULTS_DIR``, else off): write mpitrain's
    telemetry there (:mod:`.records`). ``threads``: TensorFlow's intra-op threads
    (default: the host's cores shared among its ranks, unless
    ``$TF_NUM_INTRAOP_THREADS`` says otherwise). ``keep_cpu_binding``: keep the
    launcher's CPU binding (Open MPI binds each rank to one core at -np 1 and 2).
    ``comm`` and ``process_sets`` (Horovod's sub-communicators) are not provided.
    """
    if STATE.engine is not None:
        return
    if comm is not None:
        raise unsupported("hvd.init(comm=...)", "it runs on every rank of the job; start the "
                          "ranks you want with mpirun -np N")
    if process_sets is not None:
        raise unsupported("process sets", "every collective runs on all ranks; run the groups "
                          "as separate jobs")
    from ..comm import Comm
    from .collectives import Collectives

    seconds = float(timeout if timeout is not None else os.environ.get(TIMEOUT_ENV,
                                                                       DEFAULT_TIMEOUT))
    world = Comm.world(seconds, start_timeout=start_timeout)
    STATE.comm = world
    STATE.topology = Topology.of(list(world.hosts), world.rank)
    _place_on_cpus(keep_cpu_binding, threads, STATE.topology.local_size)
    STATE.engine = Collectives(world)
    results_dir = results_dir or os.environ.get(RESULTS_ENV)
    if results_dir:
        from .records import Telemetry

        STATE.telemetry = Telemetry.start(world, STATE.engine, results_dir, seconds)
        STATE.engine.timer = STATE.telemetry.timer
    atexit.register(_at_exit)  # (after MPI's own exit hook: this one runs first)


def shutdown() -> None:
    """Stop mpitrain.horovod on this rank (collective: it tells the others, and writes
    the run's files when telemetry is on); it runs at the process's exit. A rank that
    leaves while the others still make calls ends the job: they stop at once with one
    line naming it (:meth:`.collectives.Collectives.leave`), and this rank records the
    run as failed with them. MPI itself ends when the process does; ``init`` may be
    called again."""
    engine, telemetry = STATE.engine, STATE.telemetry
    STATE.comm = STATE.engine = STATE.topology = STATE.telemetry = None
    if engine is None:
        return
    try:
        engine.leave()
    except MpitrainError as error:  # the others had not finished: they report it
        if telemetry is not None:
            telemetry.finish("failed", str(error), collective=error.everywhere)
        return
    if telemetry is not None:
        telemetry.finish("ok")


def _at_exit() -> None:
    if STATE.engine is not None:
        shutdown()


def is_initialized() -> bool:
    return STATE.engine is not None


def topology() -> Topology:
    if STATE.topology is None:
        raise NotInitialized("mpitrain.horovod has not been initialized; call hvd.init() "
                             "first (on every rank)")
    return STATE.topology


def engine():
    """The collectives' :class:`~.collectives.Collectives` (NotInitialized before ``init``)."""
    topology()
    return STATE.engine


def _place_on_cpus(keep_binding: bool, threads: Optional[int], local_size: int) -> None:
    """The CLI's placement (:func:`mpitrain.comm.placement.place`: every rank here trains)
    and TensorFlow's thread pools set from it, unless ``$TF_NUM_INTRAOP_THREADS`` says
    otherwise. TensorFlow takes them only before it runs its first op; a script that ran
    one first keeps TensorFlow's own."""
    from ..comm import placement
    from ..models.replica import set_tensorflow_threads

    intra = placement.place(keep_binding, local_size, threads=threads)
    if threads is None and os.environ.get("TF_NUM_INTRAOP_THREADS"):
        return
    set_tensorflow_threads(intra)


# ---- how an uncaught error ends the job ------------------------------------------------
def _mpitrain_error(exc: BaseException) -> Optional[MpitrainError]:
    """The mpitrain error ``exc`` is or carries (TensorFlow wraps an exception raised
    inside ``tf.function`` in an OpError whose message holds it)."""
    if isinstance(exc, MpitrainError):
        return exc
    last = STATE.last_error
    if last is not None and str(last) and str(last) in str(exc):
        return last
    return None


def _excepthook(kind, exc, tb) -> None:
    from ..comm import abort_world, launcher_rank, world_rank_if_running, world_size_if_running

    error = _mpitrain_error(exc)
    running = world_size_if_running() > 1
    if error is None:
        sys.__excepthook__(kind, exc, tb)
        if running:  # one rank's exception: end the job, as python -m mpi4py would
            sys.stderr.write(f"mpitrain: rank {world_rank_if_running()} raised the exception "
                             "above; ending the job\n")
            abort_world(EXIT_FAILURE)
        return
    rank = world_rank_if_running() if running else launcher_rank()
    if STATE.telemetry is not None:
        STATE.telemetry.finish("failed", str(error), collective=error.everywhere)
        STATE.telemetry = None
    if error.everywhere or not running:
        reporter = error.reporter or 0
        if rank == reporter:
            print_line(f"mpitrain: error: {error}")
        # every rank raised it at the same point: each ends on its own, the reporter with
        # the code (others first exiting non-zero could make mpirun drop its line)
        _leave(error.exit_code if rank == reporter else 0)
    if error.reporter not in (None, rank):
        # the reporter waits for the same ranks and ends the job with this line (its wait
        # began when it reached the call): printed once, unless it does not come
        time.sleep(REPORTER_GRACE)
    print_line(f"mpitrain: error: {error}")
    abort_world(error.exit_code)


def stop_every_rank(reason: str) -> None:
    """End every rank with exit 143 (stopped; a restart goes on), ``reason`` printed by
    rank 0 and the run's telemetry, if on, recorded as interrupted. Collective: every
    rank calls it at the same point."""
    from ..comm import world_rank_if_running

    if STATE.telemetry is not None:
        STATE.telemetry.finish("interrupted", reason)
        STATE.telemetry = None
    if world_rank_if_running() == 0:
        print_line(f"mpitrain.horovod: {reason}")
    _leave(EXIT_INTERRUPTED)


def _leave(code: int) -> None:
    """End the process with ``code`` after MPI's bounded finalize (collective: every rank
    leaves this way together), skipping the other exit hooks (the run failed)."""
    from ..comm import finalize

    finalize(bound=60)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def install_excepthook() -> None:
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook
