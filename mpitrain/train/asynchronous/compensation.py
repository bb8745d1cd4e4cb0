"""Staleness compensation (``--staleness-compensation``): how an async server damps a
gradient computed at weights ``staleness`` updates older than the ones it updates.

With N workers and no bound, a gradient is typically N-1 updates stale (2N-1 when
workers pipeline), so the effective step on the current weights grows with the
cluster until plain async SGD stops converging. The remedies:

* ``inverse``: the learning rate of that update divided by its staleness (Zhang,
  Gupta, Lian and Liu, IJCAI 2016, "Staleness-aware async-SGD");
* ``sqrt``: divided by its square root, a milder damping that keeps a round of N
  updates worth more than one worker's step (``inverse`` damps a round of N updates
  to one worker's step);
* ``dc`` (the default where its copies of the weights fit :data:`DC_BUDGET`, else
  ``sqrt``): delay compensation, DC-ASGD-a (Zheng et al., ICML 2017): the gradient
  corrected to the current weights by a first-order Taylor term with the diagonal
  of the outer product of gradients for the Hessian,
  ``g + lambda_t * g * g * (w_now - w_read)``, ``lambda_t = lambda_0 / sqrt(ms)`` per
  parameter with ``ms`` the moving mean square of the gradients (0.95). It needs
  the weights each gradient was computed at: the server keeps a copy of the weights
  of every version still leased (one model per lease in flight).

Contract: a server calls :meth:`Compensation.lent` for every lease it writes (with
the version it carries) and :meth:`Compensation.apply_to` for every gradient it
applies (with the version it was computed at); the factor multiplies that
update's scheduled learning rate. Pure numpy; one per server (its share of the
parameters under ``--servers K``). The mean square of ``dc`` starts again at zero
in a resumed run (it follows the last few dozen gradients).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np

from ...models import optim
from .pool import RESIDENT_BUDGET

#: DC-ASGD-a's moving average of the squared gradient (the paper's m)
MEAN_SQUARE_MOMENTUM = np.float32(0.95)
#: added to the mean square before its square root
EPSILON = np.float32(1e-7)
#: staleness whose damping factor is tabulated (beyond it, computed per update)
TABLE = 4096
#: --staleness-compensation auto is dc where a copy of the weights for every worker
#: fits in this many bytes (LR, LeNet, ResNet-20 at any cluster size), else sqrt: the
#: budget a server's per-worker message memory keeps to (.pool)
DC_BUDGET = RESIDENT_BUDGET


def chosen(setting: str, n_params: int, n_workers: int) -> str:
    """--staleness-compensation as it applies to a server of ``n_params`` parameters and
    ``n_workers`` workers: auto resolved (dc within DC_BUDGET, else sqrt)."""
    if setting != "auto":
        return setting
    return "dc" if 4 * n_params * n_workers <= DC_BUDGET else "sqrt"


class Compensation:
    """One server's staleness compensation over its ``n`` parameters."""

    def __init__(self, kind: str, n: int, dc_lambda: float = 2.0):
        self.kind = kind
        self.dc_lambda = np.float32(dc_lambda)
        self._table: Optional[List[float]] = None
        if kind in ("inverse", "sqrt"):
            self._table = [self.damping(s) for s in range(TABLE)]
        #: dc: the weights of each version still leased, and its leases not yet returned
        self._read: Dict[int, List] = {}
        self._mean_square = np.zeros(n if kind == "dc" else 0, np.float32)
        self._started = False

    @property
    def keeps_weights(self) -> bool:
        """Whether the server must report its leases (:meth:`lent`)."""
        return self.kind == "dc"

    def damping(self, staleness: int) -> float:
        """The factor of an update's learning rate for a gradient ``staleness`` updates
        old: 1 for a fresh one (0 or 1)."""
        if staleness <= 1 or self.kind not in ("inverse", "sqrt"):
            return 1.0
        return 1.0 / staleness if self.kind == "inverse" else 1.0 / math.sqrt(staleness)

    def factor(self, staleness: int) -> float:
        """:meth:`damping`, from its table where it has one (once per update)."""
        table = self._table
        if table is None:
            return 1.0
        return table[staleness] if staleness < TABLE else self.damping(staleness)

    def lent(self, version: int, weights: np.ndarray) -> None:
        """A lease of ``weights`` at ``version`` went out (dc: keep them until its
        gradient comes back)."""
        read = self._read.get(version)
        if read is None:
            self._read[version] = [weights.copy(), 1]
        else:
            read[1] += 1

    def apply_to(self, grad: np.ndarray, version: int, weights: np.ndarray) -> np.ndarray:
        """``grad``, computed at ``version``, corrected to ``weights`` (the current ones):
        in place, and returned. Only dc corrects; a gradient whose weights are not kept
        (its lease predates this server, e.g. a resumed run's first) is taken as it is."""
        if self.kind != "dc":
            return grad
        read = self._read.get(version)
        if read is None:  # (its gradient still counts in the mean square)
            self._correct(grad, weights, weights)
            return grad
        w_read = read[0]
        read[1] -= 1
        if read[1] == 0:
            del self._read[version]
        self._correct(grad, w_read, weights)
        return grad

    def _correct(self, grad: np.ndarray, w_read: np.ndarray, weights: np.ndarray) -> None:
        """ms = m ms + (1 - m) g^2 (ms = g^2 for the first gradient); then, in place,
        g += (w_now - w_read) g g lambda_0 / sqrt(ms + eps): one fused pass in C where it
        was built, else numpy with the same float32 operations in the same order."""
        ms = self._mean_square
        m, c = (MEAN_SQUARE_MOMENTUM, np.float32(1 - MEAN_SQUARE_MOMENTUM)) \
            if self._started else (np.float32(1.0), np.float32(0.0))
        if not self._started:  # the first gradient's square is the mean so far
            np.square(grad, out=ms)
            self._started = True
        if optim.FUSED:
            optim.delay_compensate(grad, ms, weights, w_read, m, c, self.dc_lambda,
                                   EPSILON)
            return
        ms *= m
        square = np.square(grad)
        square *= c
        ms += square
        term = np.subtract(weights, w_read)
        term *= grad
        term *= grad
        term *= self.dc_lambda
        term /= np.sqrt(ms + EPSILON)
        grad += term

    @property
    def kept(self) -> int:
        """Versions whose weights are kept (dc): the leases in flight, at most."""
        return len(self._read)
