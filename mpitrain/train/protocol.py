"""What the two training protocols share on the wire and around it.

* **Tags** of the worker <-> server messages (both modes).
* **The header**: 8 float32 slots, in front of every async message and alone as
  every sync report. Integer slots are stored bit-exact through an int32 view (a
  float32 would lose versions above 2**24):

  0. VERSION (int): async push, the version the gradient was computed at; async
     reply, the server version of these weights.
  1. STEP (int): the worker's step (sync report, async push); the step to resume
     from (async reply).
  2. FLAGS (int): sync report REPORT (else a heartbeat), FINAL, INTERRUPTED,
     DIVERGED, EVALUATE, SAVE; async push FINAL, INTERRUPTED, DIVERGED,
     FAREWELL, PIPELINED, REQUEST; async reply also DROPPED, PARKED.
  3. LOSS: sync, the running train loss; async push, the batch's (the sentinel).
  4. ELAPSED: the worker's wall time (sync report, async push).
  5. THINK: async push, its seconds of compute (the server's poll policy).
  6. EXTRA (int): async reply, steps beyond its own (a lost worker's, reassigned).
  7. AUX (int): sync report, the CRC-32 of the weights and buffers; async push,
     where its worker's shared slots hold it and take its reply (:func:`slots_word`).

* **The health sentinel** (:func:`sentinel`): one float that is not finite when
  the loss or the gradient is not; both protocols stop every rank at the step
  where a worker's sentinel went NaN or infinite.
* **SilentPeers**: the serving rank's bound on how long a peer it expects a
  message from may stay silent, and the error that names it.
* **PhaseTimer**: this rank's seconds per epoch in compute, comm and wait,
  every second of an epoch charged to exactly one of them.
"""

from __future__ import annotations

import contextlib
import struct
import time
from typing import (Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

import numpy as np

from ..errors import CommTimeout

#: message tags of the worker <-> server protocols
TAG_REPORT = 21  # sync: worker -> server progress and epoch reports (a header)
TAG_WEIGHTS = 22  # sync: worker 1 -> server weights; async: server -> worker leases
TAG_GRADIENT = 23  # async: worker -> server gradient pushes
TAG_STOP = 24  # sync: server -> worker, exactly once per run (stop now / stop listening)
TAG_STATE = 25  # sync: worker 1 -> server optimizer state at checkpoints
TAG_RNG = 26  # sync: every worker -> server random-generator state at checkpoints
TAG_CONTROL = 27  # async --servers K: rank 0 <-> the other servers, small int messages
TAG_SHARE = 28  # async --servers K: a server's share of the state -> rank 0 (a pickle)
#: sync --compression: every worker -> server its codec's state (residuals) at
#: checkpoints; server -> every worker its own on resume
TAG_CODEC = 29

#: workers tell the server they are alive (and how far they are) this often, at least
HEARTBEAT_SECONDS = 1.0

SLOTS = 8
VERSION, STEP, FLAGS, LOSS, ELAPSED, THINK, EXTRA, AUX = range(SLOTS)

# flags (the FLAGS slot)
FINAL = 1  # the sender's last message of the run
INTERRUPTED = 2  # a stop signal ended the run
DIVERGED = 4  # a non-finite loss or gradient ended the run
DROPPED = 8  # async reply: the server went on without this worker
EVALUATE = 16  # sync report: this step is an evaluation point
SAVE = 32  # sync report: this step is a checkpoint point (rank 0 saves)
REPORT = 64  # sync report: a report of a step all workers reach (else a heartbeat)
FAREWELL = 128  # async push (with FINAL): no gradient, the last word of a dismissed worker
PIPELINED = 256  # async push: its worker keeps a second push in flight (the poll policy)
#: async reply to a FINAL push (a header alone): the server keeps this worker for a lost
#: one's steps, and will speak again within --timeout (then: a lease, or FINAL)
PARKED = 512
#: async push to a server of rank > 0 under --staleness with --servers K (a header
#: alone): this worker holds the leases of the servers before it and asks for this one's
REQUEST = 1024
#: sync report: its worker found rank 0 had not yet taken the weights it sent before, and
#: waits for that (rank 0, below the workers' priority, is on their critical path)
WAITED = 2048
#: sync report (with SAVE): its worker's compression state follows it (TAG_CODEC)
CODEC = 4096


class Header(NamedTuple):
    """A header's slots as Python numbers (see the table in the module docstring)."""

    version: int = 0
    step: int = 0
    flags: int = 0
    loss: float = 0.0
    elapsed: float = 0.0
    think: float = 0.0
    extra: int = 0
    aux: int = 0

    @classmethod
    def read(cls, buf: np.ndarray) -> "Header":
        """The header in front of ``buf`` (a float32 message)."""
        return cls._make(_LAYOUT.unpack_from(buf))  # type: ignore[arg-type]  # (numpy's stubs: a buffer from 3.12)

    def write(self, buf: np.ndarray) -> np.ndarray:
        """Store this header in front of ``buf`` (a float32 message); returns ``buf``.
        A float slot beyond float32's range is stored as infinite (as numpy would)."""
        try:
            _LAYOUT.pack_into(buf, 0, *self)  # type: ignore[arg-type]  # (numpy's stubs: a buffer from 3.12)
        except OverflowError:  # struct refuses what float32 cannot hold
            with np.errstate(over="ignore"):
                floats = {k: float(np.float32(getattr(self, k))) for k in FLOAT_SLOTS}
            _LAYOUT.pack_into(buf, 0, *self._replace(**floats))  # type: ignore[arg-type]
        return buf


#: the header's bytes: int32 slots bit-exact, float slots as float32, the CRC-32
#: unsigned (one struct call each way, an order of magnitude cheaper than numpy views:
#: docs/architecture.md, "The header packed with struct")
_LAYOUT = struct.Struct("=iiifffiI")
FLOAT_SLOTS = ("loss", "elapsed", "think")
assert _LAYOUT.size == SLOTS * 4


def write_version(buf: np.ndarray, version: int) -> None:
    """Overwrite the VERSION slot of the header in front of ``buf`` (the same header to
    several servers, each with its own version: cheaper than a namedtuple's _replace)."""
    _VERSION.pack_into(buf, 0, version)  # type: ignore[arg-type]  # (numpy's stubs: a buffer from 3.12)


_VERSION = struct.Struct("=i")  # the header's first slot (see _LAYOUT)


def slots_word(push: int, lease: int) -> int:
    """An async push's AUX slot where its payload lies in memory its worker shares with
    the server: the push slot that holds it and the lease slot its reply goes to
    (:mod:`mpitrain.train.asynchronous.mailbox`); :func:`slots_of` reads it."""
    return push | lease << 8


def slots_of(word: int) -> Tuple[int, int]:
    """(push slot, lease slot) of an AUX slot written by :func:`slots_word`."""
    return word & 0xFF, word >> 8


def new_message(payload: int = 0) -> np.ndarray:
    """A zeroed float32 message: a header and ``payload`` floats after it."""
    return np.zeros(SLOTS + payload, np.float32)


def sentinel(loss: float, grad_norm: float) -> float:
    """``loss``, or NaN/inf when the loss or the gradient (through its norm) is not
    finite: the one number a worker reports for its step's health."""
    return loss + 0.0 * grad_norm


def stalled(comm, peer: int, silence: str, waiting: Sequence[int] = ()) -> CommTimeout:
    """The error that names a silent ``peer`` (``silence``: what it did not do, for how
    long); ``waiting``: the ranks held up by it."""
    held = ", ".join(comm.name(r) for r in waiting)
    return CommTimeout(
        f"{comm.name(peer)} {silence}"
        + (f" while {held} kept waiting for it" if held else "")
        + "; it is stalled or dead (raise --timeout if its steps are legitimately that slow)")


class SilentPeers:
    """The serving rank's watch over the peers it expects a message from.

    A peer's silence starts when it is heard from (sync: each report or
    heartbeat) or given something to answer (async: each lease). The server
    waits for the first of the peers' posted receives, never longer than the
    oldest silence has left until ``comm.timeout``, so it can name the peer that
    stayed silent instead of waiting forever.
    """

    def __init__(self, comm, peers: Iterable[int]):
        self.comm = comm
        now = time.monotonic()
        self.since: Dict[int, float] = {p: now for p in peers}

    def heard(self, peer: int) -> None:
        """``peer`` spoke (or was given something to answer): its silence starts now."""
        self.since[peer] = time.monotonic()

    def silent_for(self, peer: int) -> float:
        return time.monotonic() - self.since[peer]

    def first(self, posted: Dict[int, object], backoff,
              wake_every: Optional[float] = None, tested: bool = False) -> Optional[int]:
        """The peer of ``posted`` (peer -> its pending receive) whose message completed
        first; None when ``wake_every`` seconds passed first, or the oldest silence
        reached the timeout (see :meth:`overdue`). The caller restarts the peer's
        silence (:meth:`heard`) when it has read what it needs of it. ``tested``: the
        caller has just found none of them complete (see :meth:`Comm.wait_any`)."""
        peers = list(posted)
        oldest = min(self.since[p] for p in peers)  # one clock read per wait
        left = self.comm.timeout - (time.monotonic() - oldest)
        if wake_every is not None:
            left = min(left, wake_every)
        index = self.comm.wait_any([posted[p] for p in peers], backoff, timeout=max(0.0, left),
                                   tested=tested)
        return None if index is None else peers[index]

    def lost(self, posted: Dict[int, Any], liveness,
             alive: Callable[[int], bool] = lambda peer: True) -> Optional[Tuple[int, str]]:
        """(peer, why) for the first peer of ``posted`` (peer -> its pending receive)
        silent past its ``liveness`` bound (:class:`~mpitrain.train.leases.Liveness`),
        or whose process is gone (``alive``); None if none is. One whose message has
        come is not silent, only not read yet: the server's loop may have been held
        up (by its evaluation, or by the workers on its cores)."""
        for peer, pending in posted.items():
            why = liveness.lost_because(peer, self.silent_for(peer), alive(peer))
            if why and not pending.test():
                return peer, why
        return None

    def overdue(self, peers: Sequence[int]) -> Optional[int]:
        """The peer of ``peers`` silent for ``comm.timeout`` seconds or more, if any."""
        peer = max(peers, key=self.silent_for)
        return peer if self.silent_for(peer) >= self.comm.timeout else None


_now = time.perf_counter  # (one global lookup in lap, which runs four times an update)


class PhaseTimer:
    """This rank's seconds per epoch in compute, comm, wait and codec (``timing.csv``;
    codec: a gradient compression's own computing, encoding and decoding).

    Every second of an epoch is charged to one phase: what runs inside
    ``with timer("comm"):`` to that phase, everything between such blocks to
    ``default`` (the rank's main work). Protocol loops only mark the phases; the
    bookkeeping is here.
    """

    PHASES = ("compute", "comm", "wait", "codec")

    def __init__(self, default: str = "compute"):
        self.default = default
        self.rows: List[dict] = []
        # one reusable context object per phase: a generator-based context manager
        # costs microseconds per use, and the async server marks two phases per update
        self._blocks = {phase: _Phase(self, phase) for phase in self.PHASES}
        self._fastest = float("inf")  # seconds of the fastest collective (see collective)
        self.restart()

    def restart(self) -> None:
        """Start the current epoch now (drops what was charged so far)."""
        self._start = self._mark = time.perf_counter()
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._collectives = 0  # this epoch's, charged as wait until it closes

    def lap(self, phase: Optional[str] = None) -> float:
        """Charge the time since the last mark to ``phase`` (default: the default);
        returns the seconds charged."""
        now = _now()
        spent = now - self._mark
        self._mark = now
        self.seconds[phase or self.default] += spent
        return spent

    def __call__(self, phase: str) -> "_Phase":
        """``with timer(phase):`` charges the block's time to ``phase``."""
        return self._blocks[phase]

    @contextlib.contextmanager
    def collective(self) -> Iterator["Collective"]:
        """A collective call. The fastest one of the run so far, which nobody was late
        for, is what moving the data takes: when the epoch closes, that much of each
        of its collectives counts as comm, the rest as waiting for the slowest rank.
        (Learnt from the calls themselves: measuring it up front took four extra
        allreduces before the first step: docs/architecture.md, "No allreduce
        calibration".) The block may set the yielded object's ``codec``: seconds of the
        call a compression spent computing, charged to codec."""
        self.lap()
        call = Collective()
        try:
            yield call
        finally:
            spent = self.lap("wait") - call.codec
            self.seconds["wait"] -= call.codec
            self.seconds["codec"] += call.codec
            self._fastest = min(self._fastest, spent)
            self._collectives += 1

    def end_epoch(self, epoch: float) -> None:
        """Close the epoch (its last stretch charged to the default phase) as a row."""
        self.lap()
        moving = self._collectives * self._fastest if self._collectives else 0.0
        self.seconds["wait"] -= moving  # (each collective took at least the fastest)
        self.seconds["comm"] += moving
        self._collectives = 0
        self.rows.append({"epoch": epoch, "wall_s": round(self._mark - self._start, 6),
                          **{f"{p}_s": round(s, 6) for p, s in self.seconds.items()}})
        self._start = self._mark
        self.seconds = dict.fromkeys(self.PHASES, 0.0)


class Collective:
    """One :meth:`PhaseTimer.collective` call: ``codec``, the seconds of it a gradient
    compression computed (the caller sets it)."""

    __slots__ = ("codec",)

    def __init__(self):
        self.codec = 0.0


class _Phase:
    """``with timer(phase):``: what came before goes to the default phase, the block to
    ``phase``."""

    __slots__ = ("timer", "phase")

    def __init__(self, timer: PhaseTimer, phase: str):
        self.timer, self.phase = timer, phase

    def __enter__(self) -> None:
        self.timer.lap()

    def __exit__(self, *exc) -> None:
        self.timer.lap(self.phase)
