"""The collectives of ``mpitrain.horovod`` on numpy buffers.

Each call first agrees with every other rank on what it is: a header of 9 integers
(the call's sequence number, kind, reduction or root, dtype, element count, rank or
tensor count, a checksum of the shapes, whether the rank has joined, and a checksum of
the call's name) goes to every other rank point to point, and every rank checks every
header. This is
Horovod's negotiation in one small exchange instead of a coordinator's cycle, and
it buys four things:

* **Bad use is named, never garbage or a hang.** Ranks whose calls differ (another
  shape or dtype, another kind of call, a call one rank skipped, another name) all stop
  at the same call with one line naming the ranks and what each called. Names are how a
  TF1 graph's reordering is caught: ``Session.run`` runs independent collectives in any
  order on each rank, and Horovod pairs them by name where mpitrain pairs them by
  order, so two same-shaped collectives met in different orders would otherwise be
  reduced together (:mod:`.ops` names a TF1 graph's collectives after their tensors).
* **A late rank is named.** A rank that never sends its header within ``timeout``
  (stalled, dead, or stuck elsewhere) is named by the others, which end the job.
* **Sizes travel with it.** An allgather's first dimensions and an object's pickled
  size are in the headers: no second exchange.
* **``join`` works.** A rank that joined answers every later header with zeros (the
  reduction's identity) until every rank has joined.

The data then moves with mpitrain's own engine: a float sum through the exchange
protocol's :class:`mpitrain.exchange.MpiEngine` over the world communicator (the
sync trainer's gradient allreduce: in place, blocking or polled as the host allows,
bounded by the timeout; float16 moving float16), the other reductions, gathers and
broadcasts through :mod:`mpitrain.comm.reductions`. No copy is made that the caller
did not ask for. (The engine's shared-memory sum needs the buffer in memory the ranks
map; a tensor's buffer is TensorFlow's, so the sums go through MPI.)

Cross-rank contract: every rank makes the same calls in the same order (what
Horovod requires too); a rank that joined takes part in the others' allreduces and
barriers only. Scaling follows Horovod's CPU path exactly (``prescale_factor`` before
the sum, ``postscale_factor`` and the average's 1/size after it, in the buffer's
precision, float32 factors for float32 and float16 buffers), so where the sum's order
is the same the results are Horovod's bit for bit.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import zlib
from typing import Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

from ..comm import HOT, CommTimeout, reductions
from ..errors import UsageError
from ..exchange import MpiEngine

# Horovod's reduction operations, with its numbers (horovod/common/message.h)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}
_MPI_OP = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}

# the kinds of call, and the header's fields
(ALLREDUCE, ALLGATHER, BROADCAST, BARRIER, JOIN, BROADCAST_OBJECT, ALLGATHER_OBJECT,
 LEFT, ALLTOALL) = range(1, 10)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
              BARRIER: "barrier", JOIN: "join", BROADCAST_OBJECT: "broadcast_object",
              ALLGATHER_OBJECT: "allgather_object", LEFT: "left", ALLTOALL: "alltoall"}
SEQ, KIND, ARG, DTYPE, COUNT, NDIM, SIG, FLAGS, NAME = range(9)
JOINED = 1
#: the header fields that must agree, by kind (ALLGATHER: not the first dimension)
MUST_AGREE = {ALLREDUCE: (ARG, DTYPE, COUNT, NDIM, SIG, NAME),
              ALLGATHER: (DTYPE, NDIM, SIG, NAME), ALLTOALL: (DTYPE, NDIM, SIG, NAME),
              BROADCAST: (ARG, DTYPE, COUNT, NDIM, SIG, NAME), BARRIER: (),
              BROADCAST_OBJECT: (ARG,), ALLGATHER_OBJECT: (), LEFT: ()}
#: the name a gradient tape's and optimizer's allreduces carry (counted as steps)
GRADIENTS = "gradients"
#: why calls alike but for their names meet, and the fix
RENAMED = ("; calls that differ only in their name are what a TF1 graph's Session.run makes "
           "of independent collectives (it runs them in any order on each rank; a "
           "collective there is named after its tensor unless given name=): chain them with "
           "tf.control_dependencies, fetch them in separate runs, or run the step in "
           "tf.function or eagerly")
#: the tag of the headers, on the world communicator (mpitrain's protocols use 21-26,
#: its failure reports and gathers 77-78)
TAG_HEADER = 80
DTYPES = ("float32", "float64", "float16", "int32", "int64", "int8", "uint8", "int16",
          "uint16", "uint32", "uint64", "bool", "bfloat16", "complex64", "complex128")


class Mismatch(UsageError):
    """Ranks disagree about a collective (every rank raises it at the same call; the
    first rank that did not leave reports it)."""


def _ranks_on(hosts: Sequence[str], ranks: List[int]) -> str:
    """"rank 1 on node0" or "ranks 1, 2 on node0, node1" (``hosts``: every rank's)."""
    where = f" on {', '.join(sorted({hosts[r] for r in ranks}))}"
    return (f"rank {ranks[0]}" if len(ranks) == 1 else
            f"ranks {', '.join(map(str, ranks))}") + where


def dtype_code(dtype) -> int:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise UsageError(f"mpitrain.horovod cannot exchange tensors of dtype {name}")
    return DTYPES.index(name) + 1


def shape_checksum(shape: Sequence) -> int:
    """A number that differs (almost surely) between different shapes; ``shape`` may be
    a list of shapes (a grouped call)."""
    return zlib.crc32(repr(shape).encode())


class Collectives:
    """The collectives over one :class:`~mpitrain.comm.Comm` (every rank of the job).

    Thread-safe: calls from several threads run one at a time. ``timer``: a
    :class:`mpitrain.train.protocol.PhaseTimer` whose comm and wait phases every call
    is charged to (telemetry), or None.

    Why one class of this size (over the ~250 lines we hold classes to): each public
    call is a few lines around the one header exchange (:meth:`_agree`), whose state
    (the table of every rank's header, the sequence number, who joined, the lock) every
    call shares; split, the calls would reach into another object's protocol state.
    """

    def __init__(self, comm):
        self.comm = comm
        #: the sums of float buffers: mpitrain's gradient engine (the exchange protocol)
        #: over the world communicator; every rank trains
        self.summing = MpiEngine(comm)
        self.rank, self.size = comm.rank, comm.size
        self.table = np.zeros((comm.size, NAME + 1), np.int64)  # every rank's header, by rank
        self.seq = 0
        self.joined = False
        self._joined_at: Dict[int, int] = {}  # rank -> the call at which it was seen joined
        self._lock = threading.RLock()
        self._half: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        self.timer = None
        #: allreduces of gradients (a DistributedGradientTape's or DistributedOptimizer's
        #: exchanges, named "gradients"): the training steps, for telemetry
        self.gradient_exchanges = 0

    # ---- the calls ---------------------------------------------------------------------
    def allreduce_(self, buf: np.ndarray, op: int = Average, prescale: float = 1.0,
                   postscale: float = 1.0, shape=None, name: str = "") -> np.ndarray:
        """Reduce ``buf`` (contiguous) over every rank with ``op``, in place. ``shape``:
        what the caller's tensors look like, for the checks and messages (default:
        ``buf``'s shape); a grouped call passes the list of its shapes."""
        if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.flags.writeable):
            raise TypeError("allreduce_ reduces a writable, contiguous numpy array in place")
        shape = buf.shape if shape is None else shape
        with self._call():
            self._agree(ALLREDUCE, op, dtype_code(buf.dtype), buf.size, _ndim(shape),
                        shape_checksum(shape),
                        lambda: _described(ALLREDUCE, buf.dtype, shape, name, OP_NAMES[op]),
                        name)
            self.gradient_exchanges += name == GRADIENTS
            return self._reduce_(buf, op, prescale, postscale, name)

    def allreduce_compressed_(self, buf: np.ndarray, codec, op: int = Average,
                              prescale: float = 1.0, postscale: float = 1.0, shape=(),
                              name: str = "") -> np.ndarray:
        """:meth:`allreduce_` of a float32 ``buf`` holding tensors of ``shape`` (a list of
        shapes) through ``codec``'s engine for them
        (:class:`mpitrain.horovod.compression.SumReplacing`: PowerSGD, top-k): Sum and
        Average only, every rank getting the same bits."""
        with self._call():
            self._agree(ALLREDUCE, op, dtype_code(buf.dtype), buf.size, _ndim(shape),
                        shape_checksum(shape),
                        lambda: _described(ALLREDUCE, buf.dtype, shape, name, OP_NAMES[op]),
                        name)
            if op not in (Sum, Average):
                raise UsageError(f"Compression.{codec.name} approximates a sum: the "
                                 f"{OP_NAMES.get(op, op)} reduction takes Compression.none")
            self.gradient_exchanges += name == GRADIENTS
            flat = buf.reshape(-1)
            if prescale != 1.0:
                scale_(flat, prescale)
            codec.engine_for(self.summing, shape).allreduce_sum_(
                flat, what=_what(ALLREDUCE, name))
            factor = postscale / self.size if op == Average else postscale
            if factor != 1.0:
                scale_(flat, factor)
            return buf

    def allgather(self, arr: np.ndarray, name: str = "") -> np.ndarray:
        """Every rank's ``arr`` concatenated along the first dimension, in rank order; the
        first dimension may differ between ranks, the others may not."""
        arr = np.ascontiguousarray(arr)
        if arr.ndim == 0:
            raise UsageError("allgather needs a tensor of at least one dimension (got a "
                             "scalar); reshape it to [1]")
        rest = arr.shape[1:]
        with self._call():
            self._agree(ALLGATHER, 0, dtype_code(arr.dtype), arr.shape[0], arr.ndim,
                        shape_checksum(rest),
                        lambda: _described(ALLGATHER, arr.dtype, arr.shape, name), name)
            rows = self.table[:, COUNT].copy()
            out = np.empty((int(rows.sum()),) + rest, arr.dtype)
            per_row = int(np.prod(rest, dtype=np.int64))
            return reductions.allgatherv(self.comm, arr, rows * per_row, out,
                                         _what(ALLGATHER, name), "allgather")

    def alltoall(self, arr: np.ndarray, splits: Optional[np.ndarray] = None,
                 name: str = "") -> Tuple[np.ndarray, np.ndarray]:
        """Rank r gets ``splits[r]`` rows of ``arr`` (its first dimension, in rank order;
        ``splits`` None: as many rows to each rank); returns the rows every rank sent this
        one, in rank order, and how many came from each. The first dimension may differ
        between ranks, the others may not."""
        arr = np.ascontiguousarray(arr)
        splits = alltoall_splits(arr.shape, splits, self.size)
        rest = arr.shape[1:]
        with self._call():
            self._agree(ALLTOALL, 0, dtype_code(arr.dtype), arr.shape[0], arr.ndim,
                        shape_checksum(rest),
                        lambda: _described(ALLTOALL, arr.dtype, arr.shape, name), name)
            every = np.empty((self.size, self.size), np.int64)  # row r: rank r's splits
            reductions.allgatherv(self.comm, splits, [self.size] * self.size, every,
                                  "the alltoall's splits", "alltoall")
            received = every[:, self.rank].copy()
            per_row = int(np.prod(rest, dtype=np.int64))
            out = np.empty((int(received.sum()),) + rest, arr.dtype)
            reductions.alltoallv(self.comm, arr, splits * per_row, received * per_row, out,
                                 _what(ALLTOALL, name))
        return out, received.astype(np.int32)

    def broadcast_(self, buf: np.ndarray, root: int, name: str = "") -> np.ndarray:
        """Overwrite ``buf`` (contiguous) on every rank with rank ``root``'s, in place."""
        if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.flags.writeable):
            raise TypeError("broadcast_ overwrites a writable, contiguous numpy array in place")
        self._check_root(root)
        with self._call():
            self._agree(BROADCAST, root, dtype_code(buf.dtype), buf.size, buf.ndim,
                        shape_checksum(buf.shape),
                        lambda: _described(BROADCAST, buf.dtype, buf.shape, name,
                                           f"from rank {root}"), name)
            return reductions.broadcast_(self.comm, buf, root, _what(BROADCAST, name))

    def broadcast_object(self, obj, root: int = 0):
        """Rank ``root``'s ``obj`` (pickled) on every rank."""
        self._check_root(root)
        payload = _pickle(obj) if self.rank == root else b""
        with self._call():
            self._agree(BROADCAST_OBJECT, root, 0, len(payload), 0, 0,
                        lambda: f"broadcast_object from rank {root}")
            n = int(self.table[root, COUNT])
            buf = np.frombuffer(payload, np.uint8).copy() if self.rank == root \
                else np.empty(n, np.uint8)
            reductions.broadcast_(self.comm, buf, root, "broadcast_object")
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def allgather_object(self, obj) -> list:
        """Every rank's ``obj`` (pickled), in rank order."""
        payload = np.frombuffer(_pickle(obj), np.uint8)
        with self._call():
            self._agree(ALLGATHER_OBJECT, 0, 0, payload.size, 0, 0,
                        lambda: "allgather_object")
            sizes = self.table[:, COUNT].copy()
            out = np.empty(int(sizes.sum()), np.uint8)
            reductions.allgatherv(self.comm, payload, sizes, out, "allgather_object")
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(out[offsets[r]:offsets[r + 1]].tobytes()) for r in range(self.size)]

    def leave(self) -> None:
        """This rank's script has ended: its header says so at its next call. Ranks
        that all leave together exchange headers once; ranks still calling raise, with
        this rank, the Mismatch naming it at once, not after the timeout."""
        with self._call():
            self._agree(LEFT, 0, 0, 0, 0, 0,
                        lambda: "left the job (its script ended or called sys.exit)")

    def barrier(self) -> None:
        """Return once every rank has called it (the headers' exchange is the barrier)."""
        with self._call():
            self._agree(BARRIER, 0, 0, 0, 0, 0, lambda: "barrier")

    def join(self) -> int:
        """Wait until every rank has joined, taking part meanwhile in the allreduces and
        barriers of the ranks that have not (with zeros: the reduction's identity);
        returns the rank that joined last."""
        with self._call():
            self.joined = True
            try:
                while True:
                    active = self._agree(JOIN, 0, 0, 0, 0, 0, lambda: "join")
                    if not active:
                        return max(self._joined_at, key=lambda r: (self._joined_at[r], r))
                    header = self.table[active[0]]
                    if header[KIND] == ALLREDUCE:
                        self._reduce_(_identity(int(header[ARG]), int(header[DTYPE]),
                                                int(header[COUNT])), int(header[ARG]))
            finally:
                self.joined = False
                self._joined_at.clear()

    # ---- how a call runs -------------------------------------------------------------
    @contextlib.contextmanager
    def _call(self):
        with self._lock:
            timer = self.timer
            if timer is None:
                yield
            else:
                with timer.collective():
                    yield

    def _agree(self, kind: int, arg: int, dtype: int, count: int, ndim: int, sig: int,
               describe: Callable[[], str], name: str = "") -> List[int]:
        """Exchange this call's header with every rank and check them; the ranks that
        have not joined. Raises :class:`Mismatch` on every rank alike, or CommTimeout
        naming the ranks whose headers did not come."""
        self.seq += 1
        mine = self.table[self.rank]
        mine[:] = (self.seq, kind, arg, dtype, count, ndim, sig, JOINED if self.joined else 0,
                   zlib.crc32(name.encode()))
        if self.size > 1:
            self._exchange(describe)
        table = self.table
        for r in range(self.size):
            if table[r, FLAGS] & JOINED:
                self._joined_at.setdefault(r, self.seq)
        active = [r for r in range(self.size) if not table[r, FLAGS] & JOINED]
        kinds = {int(table[r, KIND]) for r in active}
        fields = MUST_AGREE.get(next(iter(kinds)), ()) if len(kinds) == 1 else ()
        differ = [f for f in fields if len({int(table[r, f]) for r in active}) > 1]
        agreed = len(kinds) <= 1 and not differ
        if agreed and (not active or len(active) == self.size
                       or kinds <= {ALLREDUCE, BARRIER}):
            return active
        self._disagree(describe(), agreed, renamed=differ == [NAME])

    def _exchange(self, describe: Callable[[], str]) -> None:
        comm, mine = self.comm, self.table[self.rank]
        peers = [r for r in range(self.size) if r != self.rank]
        receives = [comm.irecv(self.table[p], p, TAG_HEADER, "control", "a collective's header")
                    for p in peers]
        sends = [comm.isend(mine, p, TAG_HEADER, "control", "a collective's header")
                 for p in peers]
        try:
            comm.wait_all(receives + sends, HOT)
        except CommTimeout:
            late = [p for p, pending in zip(peers, receives) if not pending.test()]
            raise self._late(late, describe()) from None

    def _late(self, late: List[int], what: str) -> CommTimeout:
        names = ", ".join(self.comm.name(r) for r in late) or "a rank"
        who = "it is" if len(late) <= 1 else "they are"
        error = CommTimeout(
            f"{self.comm.name(self.rank)} waited {self.comm.timeout:g} s for {names} to reach "
            f"collective #{self.seq} ({what}): {who} stalled or dead, or not making this call "
            "(if a step legitimately takes longer, raise hvd.init(timeout=...) or "
            "$MPITRAIN_TIMEOUT)")
        error.reporter = min(set(range(self.size)) - set(late))  # all wait for the same
        return error

    def _disagree(self, mine: str, same_call: bool, renamed: bool = False) -> NoReturn:
        """Raise the Mismatch every rank raises at this call, naming what each called."""
        said = self.comm.allgather_objects("hvd.join()" if self.joined else mine)
        groups: Dict[str, List[int]] = {}
        for r, text in enumerate(said):
            groups.setdefault(text, []).append(r)
        parts = "; ".join(f"{_ranks_on(self.comm.hosts, ranks)}: {text}"
                          for text, ranks in groups.items())
        if same_call:  # every active rank made the same call: some had joined
            error = Mismatch(f"collective #{self.seq}: {parts}; while a rank has called "
                             "hvd.join(), the others may only allreduce and barrier")
        else:
            error = Mismatch(f"the ranks disagree at collective #{self.seq}: {parts}; every "
                             "rank must make the same collective calls, with the same shapes, "
                             "dtypes and names, in the same order" + (RENAMED if renamed else ""))
        staying = [r for r in range(self.size) if self.table[r, KIND] != LEFT]
        error.reporter = staying[0] if staying else 0
        raise error

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise UsageError(f"root_rank {root} is not a rank of this job (0..{self.size - 1})")

    def _reduce_(self, buf: np.ndarray, op: int, prescale: float = 1.0,
                 postscale: float = 1.0, name: str = "") -> np.ndarray:
        """The data of an allreduce (the headers agreed): Horovod's CPU path, scaling
        included."""
        if op not in _MPI_OP:
            raise UsageError(f"mpitrain.horovod does not provide the {OP_NAMES.get(op, op)} "
                             "reduction: use Average, Sum, Min, Max or Product")
        flat = buf.reshape(-1)
        if prescale != 1.0:
            scale_(flat, prescale)
        what = _what(ALLREDUCE, name)
        if flat.dtype == np.float16 and _MPI_OP[op] == "sum":
            self._sum_half_(flat, what)
        elif flat.dtype == np.float32 and _MPI_OP[op] == "sum":
            self.summing.allreduce_sum_(flat, what=what)
        else:
            _reduce_through_mpi_(self.comm, flat, op, what)
        factor = postscale / self.size if op == Average else postscale
        if factor != 1.0 and flat.dtype != np.bool_:
            scale_(flat, factor)
        return buf

    def _sum_half_(self, flat: np.ndarray, what: str) -> None:
        """A float16 sum moving float16 (:meth:`Comm.allreduce_sum_half_`: each segment
        summed in float32 by one rank, then rounded to float16 once)."""
        n = flat.size
        if n not in self._half:
            self._half[n] = (np.zeros(-(-n // self.size) * self.size, np.float16),
                             np.empty(n, np.float32))
        half, out = self._half[n]
        half[:n] = flat
        self.summing.allreduce_sum_half_(half, out, what)
        flat[:] = out


def _reduce_through_mpi_(comm, flat: np.ndarray, op: int, what: str) -> None:
    """Reduce ``flat`` in place with MPI's own operation for ``op``: float16 (MPI has no
    float16 min, max or product) in float32, exact for min and max and rounded once for
    the product; bool as uint8 (and: min, or: max)."""
    if flat.dtype == np.float16:
        wide = flat.astype(np.float32)
        reductions.allreduce_(comm, wide, _MPI_OP[op], what)
        flat[:] = wide
    elif flat.dtype == np.bool_:
        reductions.allreduce_(comm, flat.view(np.uint8), "min" if op in (Min, Product)
                              else "max", what)
    else:
        reductions.allreduce_(comm, flat, _MPI_OP[op], what)


def scale_(flat: np.ndarray, factor: float) -> None:
    """``flat *= factor`` as Horovod's ScaleBuffer does it: float32 (and float16) buffers
    times the factor rounded to float32, float64 in double, integers through double,
    truncated."""
    if flat.dtype in (np.float32, np.float16):
        np.multiply(flat, np.float32(factor), out=flat, casting="unsafe")
    elif flat.dtype.kind in "iu":
        np.multiply(flat, float(factor), out=flat, casting="unsafe")
    else:
        np.multiply(flat, factor, out=flat, casting="unsafe")


def alltoall_splits(shape: Sequence[int], splits, size: int) -> np.ndarray:
    """The rows an alltoall of a tensor of ``shape`` sends to each of ``size`` ranks;
    ValueError (Horovod's InvalidArgumentError) where they cannot be."""
    if len(shape) == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension (got a scalar); "
                         "reshape it to [1]")
    if splits is None:
        if shape[0] % size:
            raise ValueError(f"alltoall without splits sends as many rows to each of the "
                             f"{size} ranks, but the first dimension is {shape[0]}: pass "
                             "splits=")
        return np.full(size, shape[0] // size, np.int64)
    splits = np.asarray(splits, np.int64).reshape(-1)
    if splits.size != size or (splits < 0).any() or splits.sum() > shape[0]:
        raise ValueError(f"alltoall's splits {splits.tolist()} must be {size} counts (one a "
                         f"rank), none negative, summing to at most the first dimension "
                         f"({shape[0]})")
    return splits


def _identity(op: int, code: int, count: int) -> np.ndarray:
    """``count`` values of dtype ``code`` that leave the reduction ``op`` unchanged."""
    dtype = np.dtype(DTYPES[code - 1])
    if op in (Min, Max) and dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.full(count, info.max if op == Min else info.min, dtype)
    if op in (Min, Max) and dtype.kind == "f":
        return np.full(count, np.inf if op == Min else -np.inf, dtype)
    if op == Product or (op == Min and dtype == np.bool_):
        return np.ones(count, dtype)
    return np.zeros(count, dtype)


def _ndim(shape) -> int:
    """A shape's rank, or a group's number of tensors."""
    return len(shape) if shape and isinstance(shape[0], (tuple, list)) else len(tuple(shape))


def _what(kind: int, name: str) -> str:
    return f"the {KIND_NAMES[kind]}" + (f" '{name}'" if name else "")


def _described(kind: int, dtype, shape, name: str, extra: str = "") -> str:
    grouped = bool(shape) and isinstance(shape[0], (tuple, list))
    shapes = (f"{len(shape)} {np.dtype(dtype).name} tensors {list(map(tuple, shape))}"
              if grouped else f"{np.dtype(dtype).name} {tuple(shape)}")
    return " ".join(p for p in (KIND_NAMES[kind], extra, shapes, f"'{name}'" if name else "")
                    if p)


def _pickle(obj) -> bytes:
    try:
        return pickle.dumps(obj)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle  # functions and lambdas, as Horovod's broadcast_object takes

        return cloudpickle.dumps(obj)
