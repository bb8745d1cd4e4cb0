"""Rank 0 and the other parameter servers (``--servers K``): what they tell each other.

Rank 0 stays the one server that decides about the run (evaluations, checkpoints,
quotas, dismissals, lost workers); ranks 1..K-1 (:mod:`.partition_server`) each apply
their share of every push and answer it, and learn from rank 0 what concerns them:

* **start** (0 -> s, once): the share's parameters and optimizer state, the version,
  and each worker's position and staleness counts (a resumed run's).
* **cut** (0 -> s, at each evaluation or checkpoint point): every worker's position,
  the step of its last push rank 0 has applied; s answers at once (**ack**), applies
  until it has every push up to those positions and none past them (a later push is
  held), and sends rank 0 its share's state there (**share**), then goes on. Rank 0
  first drains: it withholds its replies until every push the workers can send
  without one has come in, so no server can be past the positions it sends, and
  resumes once every server acked. So every share of a checkpoint or an evaluation
  holds exactly the same pushes: one canonical state, as with one server.
* **drop** (0 -> s): a worker lost under ``--enable-recovery``; s stops listening to it.
* **final** (s -> 0): when every worker said farewell, the share's final state and
  s's per-worker counts (staleness, pushes applied).

Control messages are small int64 arrays (TAG_CONTROL); states are pickles, their
length first (TAG_SHARE). Every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ....comm import IDLE, PeerProcesses, Pending, recovery_enabled
from ....errors import CommTimeout
from ....run.checkpoint import Checkpoint
from ...protocol import TAG_CONTROL, TAG_SHARE
from ..store import whole_state

#: control operations (slot 0 of a control message)
CUT, ACK, DROP = 1, 2, 3
#: a position that says: this worker is gone (lost), wait for nothing of it
GONE = -1


def control_message(comm) -> np.ndarray:
    """A control buffer: [operation, argument, then (rank, position) per rank]."""
    return np.zeros(2 + 2 * comm.size, np.int64)


class ObjectOut:
    """A pickled object on its way to a peer (its length, then its bytes, TAG_SHARE);
    the buffers live until :meth:`wait` (or :meth:`test`) saw both sent."""

    def __init__(self, comm, obj, dest: int, what: str):
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self.buffers = (np.array([data.size], np.int64), data)
        self.sends = [comm.isend(buf, dest, TAG_SHARE, "control", what)
                      for buf in self.buffers]
        self.comm = comm

    def test(self) -> bool:
        return all(s.test() for s in self.sends)

    def wait(self) -> None:
        self.comm.wait_all(self.sends, IDLE)


class ObjectIn:
    """A pickled object from ``source`` (see :class:`ObjectOut`), received in two steps:
    :meth:`poll` returns it once complete (None before), :meth:`wait` waits for it."""

    def __init__(self, comm, source: int, what: str):
        self.comm, self.source, self.what = comm, source, what
        self.length = np.zeros(1, np.int64)
        self.pending = comm.irecv(self.length, source, TAG_SHARE, "control", what)
        self.data: Optional[np.ndarray] = None

    def poll(self):
        if not self.pending.test():
            return None
        if self.data is None:  # the length came: now the bytes
            self.data = np.empty(int(self.length[0]), np.uint8)
            self.pending = self.comm.irecv(self.data, self.source, TAG_SHARE, "control",
                                           self.what)
            if not self.pending.test():
                return None
        return pickle.loads(self.data.tobytes())

    def wait(self):
        deadline = time.monotonic() + self.comm.timeout
        while True:
            obj = self.poll()
            if obj is not None:
                return obj
            self.comm.wait(self.pending, IDLE,
                           timeout=max(0.0, deadline - time.monotonic()))


class PartitionServers:
    """Rank 0's side of the other parameter servers (ranks 1..K-1). With one server
    (``enabled`` False) every method is cheap and does nothing."""

    def __init__(self, ctx):
        self.ctx, self.comm = ctx, ctx.comm
        self.ranks = list(range(1, ctx.cfg.asynchronous.servers))
        self.enabled = bool(self.ranks)
        self.cuts = 0  # cuts made so far (their id)
        #: the cut being gathered: (id, rank 0's own state, what to do with the whole)
        self.gathering: Optional[dict] = None
        self.inbox: Dict[int, ObjectIn] = {}
        self.received: Dict[int, dict] = {}
        self.finals: Dict[int, dict] = {}
        #: control sends not yet known complete, each with its buffer
        self._out: List[Tuple[np.ndarray, Pending]] = []
        self.processes = PeerProcesses(self.comm, self.ranks) \
            if self.enabled and recovery_enabled() else None

    # ---- start ------------------------------------------------------------------------
    def start(self, states: Dict[int, dict]) -> None:
        """Send each server its start: ``states[s]`` (its share's state, the workers'
        positions and its staleness counts). Waits until every one is sent."""
        outs = [ObjectOut(self.comm, states[s], s, f"{self.comm.name(s)} to take its "
                          "share of the parameters") for s in self.ranks]
        for out in outs:
            out.wait()

    # ---- cuts -------------------------------------------------------------------------
    def cut(self, positions: Dict[int, int], own: dict, then) -> None:
        """Every server's share at ``positions`` (worker rank -> the step of its last push
        rank 0 applied, or GONE), rank 0's own being ``own``: tell them, wait for every
        ack (then rank 0 may reply again), and gather their shares meanwhile;
        ``then(whole)`` runs once they are all in (:meth:`poll`)."""
        self.finish_gathering()  # (a cut at a time)
        self.cuts += 1
        message = control_message(self.comm)
        message[:2] = CUT, self.cuts
        for i, (rank, step) in enumerate(sorted(positions.items())):
            message[2 + 2 * i:4 + 2 * i] = rank, step
        acks = {s: control_message(self.comm) for s in self.ranks}
        waits = [self.comm.irecv(acks[s], s, TAG_CONTROL, "control",
                                 f"{self.comm.name(s)} to ack the cut") for s in self.ranks]
        sends = [self.comm.isend(message, s, TAG_CONTROL, "control",
                                 f"{self.comm.name(s)} to take the cut") for s in self.ranks]
        self.comm.wait_all(sends + waits, IDLE)
        self.gathering = {"id": self.cuts, "own": own, "then": then}
        self.inbox = {s: ObjectIn(self.comm, s, f"{self.comm.name(s)}'s share at the cut")
                      for s in self.ranks}
        self.received = {}

    def poll(self) -> None:
        """Take the shares that came in; complete the cut when all have."""
        if self.gathering is None:
            return
        for s, inbox in list(self.inbox.items()):
            share = inbox.poll()
            if share is not None:
                self.received[s] = share
                del self.inbox[s]
        if not self.inbox:
            gathering, self.gathering = self.gathering, None
            gathering["then"](self._whole(gathering["own"], self.received))

    def finish_gathering(self) -> None:
        """Wait for the cut being gathered, if any, and complete it."""
        if self.gathering is None:
            return
        for s, inbox in self.inbox.items():
            self.received[s] = inbox.wait()
        self.inbox = {}
        self.poll()

    def _whole(self, own: dict, shares: Dict[int, dict]) -> dict:
        """Rank 0's ``own`` cut state and the others' ``shares`` as one."""
        parts = [own["state"]] + [shares[s]["state"] for s in self.ranks]
        return {"state": whole_state(parts),
                "staleness": {s: shares[s]["staleness"] for s in self.ranks}}

    # ---- drops and the end ------------------------------------------------------------
    def drop(self, rank: int) -> None:
        """Tell every server that worker ``rank`` is lost."""
        message = control_message(self.comm)
        message[:2] = DROP, rank
        for s in self.ranks:
            self._out.append((message, self.comm.isend(
                message, s, TAG_CONTROL, "control", f"{self.comm.name(s)} to take a drop")))

    def finals_in(self) -> Dict[int, dict]:
        """Every server's final report (waits for them: each sends it once every worker
        has said farewell to it)."""
        self.finish_gathering()
        for s in self.ranks:
            if s not in self.finals:
                self.finals[s] = ObjectIn(self.comm, s, f"{self.comm.name(s)}'s final "
                                          "share").wait()
        self.comm.wait_all([send for _, send in self._out], IDLE)
        self._out = []
        return self.finals

    def whole_final(self, own: dict) -> dict:
        """The run's final state: rank 0's ``own`` and every server's final share."""
        return self._whole(own, self.finals_in())

    def lost(self) -> Optional[str]:
        """Why the run cannot go on, when a server's process is gone (seen on this host,
        or reported by MPI under ULFM), else None. Only under --enable-recovery: there
        the job outlives a dead rank, but a share of the parameters went with it."""
        if self.processes is None:
            return None
        for s in self.ranks:
            if not self.processes.alive(s):
                return (f"{self.comm.name(s)}, the parameter server of a share of the "
                        "parameters, died; mpitrain launch restarts the run from its last "
                        "checkpoint")
        return None


def completed(ckpt: Checkpoint, whole: dict) -> Checkpoint:
    """``ckpt`` (rank 0's, of its share) with every server's parameters and optimizer
    state (``whole``, :meth:`PartitionServers.cut`'s or the end's), and each other
    server's staleness counts (a run resumed with as many servers goes on counting)."""
    state = whole["state"]
    optimizer = {k: v for k, v in state.items() if k not in ("weights", "version")}
    return dataclasses.replace(ckpt, weights=state["weights"], optimizer=optimizer,
                               meta=ckpt.meta.with_partition_staleness(whole["staleness"]))


def raise_if_lost(servers: PartitionServers) -> None:
    why = servers.lost()
    if why:
        raise CommTimeout(why)
