"""Which parameters each async parameter server owns (``--servers K``).

The model's parameters are one flat float32 vector (:class:`mpitrain.models.replica.
Replica`). With K servers, server s (rank s) owns the contiguous share
``[bounds[s], bounds[s + 1])`` of it: K shares of equal length, their boundaries on
multiples of ALIGN values, so they differ by fewer than ALIGN values. Every server
owns a share even of a small model (LR's 7,850 values over two servers: 3,920 and
3,930). The BatchNorm statistics (buffers) belong to server 0, which evaluates.

Why contiguous shares and not BytePS's 4 MB chunks dealt round-robin: BytePS pushes
each tensor as back-propagation produces it, so it cuts large tensors into chunks to
spread one tensor over the servers and to start its transfer early. mpitrain pushes
one fused gradient per step; a contiguous share is already balanced to a few values,
a worker moves it with one message per server (MPI's transports cut a large message
into fragments themselves) and a server applies it in one pass. docs/architecture.md.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

from ....errors import UsageError

#: shares start on multiples of this many values (64 bytes: a cache line, and whole
#: float16 pairs under --compression fp16)
ALIGN = 16


class Partition(NamedTuple):
    """The shares of ``servers`` parameter servers: ``bounds[s]:bounds[s + 1]``."""

    bounds: Tuple[int, ...]

    @classmethod
    def even(cls, n: int, servers: int) -> "Partition":
        """``n`` values in ``servers`` contiguous shares balanced by size (see module)."""
        if servers > n:
            raise UsageError(f"--servers {servers}: the model has only {n} parameter(s), "
                             "fewer than the servers that would share them")
        align = ALIGN if n >= servers * ALIGN else 1
        inner = [(s * n // servers) // align * align for s in range(1, servers)]
        return cls((0, *inner, n))

    @property
    def servers(self) -> int:
        return len(self.bounds) - 1

    @property
    def n(self) -> int:
        """Values in all the shares."""
        return self.bounds[-1]

    def share(self, server: int) -> slice:
        """The values server ``server`` owns."""
        return slice(self.bounds[server], self.bounds[server + 1])

    def size(self, server: int) -> int:
        return self.bounds[server + 1] - self.bounds[server]


def partition_of(ctx) -> Partition:
    """The run's partition: its model's parameters over its ``--servers``."""
    return Partition.even(ctx.replica.n_params, ctx.cfg.asynchronous.servers)
