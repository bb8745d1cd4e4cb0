"""The exact traffic table: payload bytes, messages and wait seconds, by kind."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import List


@dataclass
class Traffic:
    """Payload bytes and messages through this rank's communication layer, by kind."""

    sent_bytes: dict = field(default_factory=lambda: defaultdict(int))
    sent_msgs: dict = field(default_factory=lambda: defaultdict(int))
    recv_bytes: dict = field(default_factory=lambda: defaultdict(int))
    recv_msgs: dict = field(default_factory=lambda: defaultdict(int))
    #: seconds spent blocked in :meth:`Comm.wait`, by kind
    wait_seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add_sent(self, kind: str, nbytes: int) -> None:
        self.sent_bytes[kind] += nbytes
        self.sent_msgs[kind] += 1

    def add_recv(self, kind: str, nbytes: int) -> None:
        self.recv_bytes[kind] += nbytes
        self.recv_msgs[kind] += 1

    def rows(self) -> List[dict]:
        """One row per kind: kind, sent/received bytes and messages, wait seconds."""
        kinds = sorted(set(self.sent_bytes) | set(self.recv_bytes) | set(self.wait_seconds))
        return [{"kind": k, "sent_bytes": self.sent_bytes[k], "sent_msgs": self.sent_msgs[k],
                 "recv_bytes": self.recv_bytes[k], "recv_msgs": self.recv_msgs[k],
                 "wait_s": round(self.wait_seconds[k], 6)} for k in kinds]
