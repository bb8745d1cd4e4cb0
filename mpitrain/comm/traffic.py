"""The exact traffic table: payload bytes, messages and wait seconds, by kind."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List


def _table_property(name: str, doc: str) -> property:
    """A property of :class:`Traffic` that reads its table ``name``."""
    return property(lambda self: self._table(name), doc=doc)


class Traffic:
    """Payload bytes and messages through this rank's communication layer, by kind.

    The tables (``sent_bytes``, ``sent_msgs``, ``recv_bytes``, ``recv_msgs``,
    ``wait_seconds``: dicts by kind) are exact whenever they are read. Collectives
    on the hot path (:meth:`add_exchanged`, once per gradient allreduce) are kept
    as per-kind running totals and folded in when a table is read: one dict lookup
    a call instead of five dict updates (a few percent of an LR-sized allreduce;
    docs/architecture.md, "Traffic counted as running totals").
    """

    def __init__(self):
        self._tables = {name: defaultdict(int) for name in
                        ("sent_bytes", "sent_msgs", "recv_bytes", "recv_msgs")}
        self._tables["wait_seconds"] = defaultdict(float)
        # (the four counting tables bound once: the async loops count a message each way
        # per update, tens of thousands of times a second with no compute)
        self._sent, self._sent_n, self._recv, self._recv_n = (
            self._tables[name] for name in ("sent_bytes", "sent_msgs", "recv_bytes",
                                            "recv_msgs"))
        self._exchanged: Dict[str, list] = {}  # kind -> [calls, bytes, seconds], not folded

    def add_sent(self, kind: str, nbytes: int) -> None:
        self._sent[kind] += nbytes
        self._sent_n[kind] += 1

    def add_recv(self, kind: str, nbytes: int) -> None:
        self._recv[kind] += nbytes
        self._recv_n[kind] += 1

    def add_exchanged(self, kind: str, nbytes: int, seconds: float) -> None:
        """A collective that sent and received ``nbytes`` (one message each way, as
        counted here) and waited ``seconds``."""
        totals = self._exchanged.get(kind)
        if totals is None:
            totals = self._exchanged[kind] = [0, 0, 0.0]
        totals[0] += 1
        totals[1] += nbytes
        totals[2] += seconds

    def _table(self, name: str) -> dict:
        if self._exchanged:
            t = self._tables
            for kind, (calls, nbytes, seconds) in self._exchanged.items():
                t["sent_bytes"][kind] += nbytes
                t["recv_bytes"][kind] += nbytes
                t["sent_msgs"][kind] += calls
                t["recv_msgs"][kind] += calls
                t["wait_seconds"][kind] += seconds
            self._exchanged = {}
        return self._tables[name]

    sent_bytes = _table_property("sent_bytes", "Payload bytes sent, by kind.")
    sent_msgs = _table_property("sent_msgs", "Messages sent, by kind.")
    recv_bytes = _table_property("recv_bytes", "Payload bytes received, by kind.")
    recv_msgs = _table_property("recv_msgs", "Messages received, by kind.")
    wait_seconds = _table_property("wait_seconds", "Seconds blocked in waits, by kind "
                                   "(add to it: ``[kind] += s``).")

    def rows(self) -> List[dict]:
        """One row per kind: kind, sent/received bytes and messages, wait seconds."""
        sent_bytes, sent_msgs = self.sent_bytes, self.sent_msgs
        recv_bytes, recv_msgs, wait = self.recv_bytes, self.recv_msgs, self.wait_seconds
        kinds = sorted(set(sent_bytes) | set(recv_bytes) | set(wait))
        return [{"kind": k, "sent_bytes": sent_bytes[k], "sent_msgs": sent_msgs[k],
                 "recv_bytes": recv_bytes[k], "recv_msgs": recv_msgs[k],
                 "wait_s": round(wait[k], 6)} for k in kinds]
