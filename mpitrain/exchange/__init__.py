"""How the sync workers exchange their gradient: one engine protocol, one plan.

**The engine protocol** (:class:`Engine`): what sums the workers' fused gradient
buffer. Every engine has

* ``size``: the number of workers summing;
* ``allreduce_sum_(buf, at=0, *, what, kind, computing)``: replace ``buf`` by the
  sum of every worker's ``buf``, in place. ``buf`` is the fused buffer or its part
  from index ``at`` (an overlapped bucket); ``what`` names the call in a timeout's
  message, ``kind`` its row of the traffic table; ``computing``: this process
  computes meanwhile (it polls then, never spins). The workers' gradients arrive
  divided by their number, so the sum is the mean;
* ``fused_buffer(size)``: memory of the engine's own for the fused buffer
  (zeroed float32), or None when any buffer will do.

Its cross-rank contract: every worker makes the same calls in the same order with
buffers of the same sizes; every worker gets the bit-identical result (which keeps
sync replicas identical); every wait is bounded (a stalled or dead worker is a
:class:`~mpitrain.errors.CommTimeout` naming it, never a hang): by the workers'
``--timeout`` for MPI and shared memory, by Horovod's stall shutdown for Horovod.
``fused_buffer`` is collective, called once before the first sum. A compressing
engine also has ``state``, a copy of what a checkpoint carries of this worker's
compression (its residuals), and ``restore(state)``.

The engines (:mod:`.engines`): :class:`MpiEngine` (the workers' communicator, and
its sum through shared memory where every worker runs on one host),
:class:`~.real_horovod.HorovodEngine`, :class:`~.fp16.HalfPrecisionEngine`, which
moves any of them as float16 with error feedback, :class:`~.powersgd.PowerSGDEngine`,
which moves the gradient's matrices as low-rank factors through MPI, and
:class:`~.topk.TopKEngine`, which gathers each worker's largest values. The codecs
behind the last three also carry the async pushes (:class:`ErrorFeedback`,
:class:`~.powersgd.LowRankFeedback`, :class:`~.topk.TopKFeedback`).

**The plan** (:mod:`.plan`): ``with plan(cfg, replica, worker_comm, tail) as exchange:``
decides, once and alike on every worker, which engine sums, whether it compresses
(float16, PowerSGD or top-k), and whether the gradient goes whole after back-propagation
or in buckets while it runs (:mod:`.overlap`), and builds the exchange the sync loop
uses: ``exchange.grad(x, y) -> (buffer, loss, norm)``, ``exchange.allreduce_(buffer)``.
How a worker waits inside MPI (spin or poll) is the communicator's decision
(:func:`mpitrain.comm.spins`), made when MPI starts.

Only :mod:`mpitrain.comm` talks to MPI; this package imports TensorFlow and Horovod
only inside the Horovod engine.
"""

from .engines import Engine, MpiEngine
from .fp16 import ErrorFeedback, HalfPrecisionEngine
from .overlap import BucketedExchange, FusedExchange
from .plan import Plan, plan
from .powersgd import PowerSGDEngine
from .topk import TopKEngine

__all__ = ["Engine", "MpiEngine", "HalfPrecisionEngine", "ErrorFeedback", "PowerSGDEngine",
           "TopKEngine", "FusedExchange", "BucketedExchange", "Plan", "plan"]
