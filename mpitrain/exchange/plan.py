"""The one place that plans a sync exchange from the config."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from ..comm import SharedMemorySum, one_host
from ..errors import UsageError
from .engines import MpiEngine
from .fp16 import HalfPrecisionEngine
from .overlap import BucketedExchange, FusedExchange
from .powersgd import PowerSGDEngine
from .topk import TopKEngine

#: the compressions that need the whole gradient at once (no buckets, no overlap)
WHOLE_GRADIENT = ("powersgd", "topk")


@dataclass(frozen=True)
class Plan:
    """How the sync workers exchange their gradient: decided from the config, the
    gradient's buckets and where the workers run, so the same on every worker.

    * ``engine``: ``mpi``, ``shared`` (mpi, and parts of the fused buffer through the
      memory the workers map: they all run on one host) or ``horovod``;
    * ``every_part``: shared memory sums every part (``--shared-memory on``), not
      only those large enough to be worth it;
    * ``compression``: ``none``, ``fp16`` (the buffer moves as float16 with error
      feedback), ``powersgd`` (its matrices as low-rank factors) or ``topk`` (each
      variable's largest values, gathered), both with error feedback;
    * ``buckets``: the gradient's buckets (last layers first) allreduced while
      back-propagation runs (``--overlap``), or None: the whole buffer after it
      (always with powersgd and topk, which need the whole gradient).
    """

    engine: str
    compression: str
    buckets: Optional[List[Tuple[int, int]]]
    every_part: bool = False

    @classmethod
    def of(cls, cfg, bounds: Sequence[Tuple[int, int]], worker_comm) -> "Plan":
        """The plan for ``cfg``, a gradient in ``bounds`` (of ``--bucket-mb``) and
        ``worker_comm`` (their communicator: its ``size`` and ``hosts``). UsageError where
        ``--shared-memory on`` cannot be kept. Overlap:
        'on', or ``--shared-memory on`` (which sums the buckets), or 'auto' where the
        gradient fills two buckets or more on the mpi engine and no XLA step (which
        cannot call out to MPI)."""
        sync, shared_memory = cfg.sync, cfg.transport.shared_memory
        compression = cfg.transport.compression
        engine = "horovod" if sync.allreduce == "horovod" else "mpi"
        if engine == "mpi" and shared_memory != "off" and compression == "none":
            if one_host(worker_comm):
                engine = "shared"
            elif shared_memory == "on":
                hosts = sorted(set(worker_comm.hosts))
                raise UsageError(f"--shared-memory on needs every worker on one host; these "
                                 f"run on {len(hosts)} ({', '.join(hosts)}): use "
                                 "--shared-memory auto")
        overlap = compression not in WHOLE_GRADIENT and (
            sync.overlap == "on" or shared_memory == "on" or (
                sync.overlap == "auto" and len(bounds) >= 2 and sync.allreduce == "mpi"
                and cfg.compiler != "xla"))
        return cls(engine, compression, list(bounds) if overlap else None,
                   shared_memory == "on")


@contextmanager
def plan(cfg, replica, worker_comm, tail: int, run_dir: Optional[str] = None,
         start_step: int = 0) -> Iterator[FusedExchange]:
    """``with plan(cfg, replica, worker_comm, tail) as exchange:`` the sync exchange of
    ``replica``'s gradient and a status tail of ``tail`` values over ``worker_comm`` (the
    workers' communicator), as :meth:`Plan.of` decides, for one run from ``start_step``
    (a compression's warm-up counts from the run's start): each worker's
    gradient scaled by 1 / workers (so the sum is the mean); for Horovod, recording the
    run's timeline into ``run_dir`` while inside if ``--horovod-timeline``. Collective
    over the workers (the shared segment, Horovod's start)."""
    decided = Plan.of(cfg, replica.gradient_buckets(cfg.sync.bucket_mb * 2**20), worker_comm)
    with _engine(decided, cfg, worker_comm, run_dir) as engine:
        engine = _compressing(decided.compression, engine, cfg, replica, tail, start_step)
        scale = 1.0 / worker_comm.size
        if decided.buckets is None:
            exchange = FusedExchange(replica, engine, tail, scale)
        else:
            # it only catches a thread gone: each bucket's own wait is bounded
            bound = cfg.faults.bounds.bucket_thread(len(decided.buckets))
            exchange = BucketedExchange(replica, engine, tail, scale, decided.buckets, bound,
                                        worker_comm.name(worker_comm.rank))
        try:
            yield exchange
        finally:
            exchange.close()


def _compressing(compression: str, engine, cfg, replica, tail: int, start_step: int):
    """``engine`` moving the gradient compressed as ``compression`` says."""
    n, t = replica.n_params, cfg.transport
    if compression == "fp16":
        return HalfPrecisionEngine(engine, n, n + tail)
    if compression == "powersgd":
        return PowerSGDEngine(engine, replica.shapes, n, n + tail, t.compression_rank,
                              t.compression_min_size, t.compression_warmup, cfg.seed,
                              steps=start_step)
    if compression == "topk":
        return TopKEngine(engine, replica.shapes, n, n + tail, t.compression_ratio,
                          t.compression_min_size, t.compression_warmup, steps=start_step)
    return engine


@contextmanager
def _engine(decided: Plan, cfg, worker_comm, run_dir: Optional[str]):
    if decided.engine != "horovod":
        shared = None if decided.engine != "shared" else (
            SharedMemorySum(worker_comm, min_bytes=0) if decided.every_part
            else SharedMemorySum(worker_comm))
        yield MpiEngine(worker_comm, shared)
        return
    from .real_horovod import HorovodEngine

    engine = HorovodEngine(worker_comm, cfg.faults.bounds)
    with engine.timeline(f"{run_dir}/horovod-timeline.json" if cfg.sync.horovod_timeline
                         else None):
        yield engine
