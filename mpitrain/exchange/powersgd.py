"""PowerSGD (``--compression powersgd``): a worker's weight matrices travel as two thin
factors of rank R, found by one step of power iteration warm-started from the last
step's (Vogels, Karimireddy and Jaggi, "PowerSGD", NeurIPS 2019; what PyTorch DDP's
``powerSGD_hook`` does). For a layer's kernel M of n x m values (a convolution's viewed
as fan-in x filters) every worker sends R (n + m) values a step instead of n m.

Each step, every worker, for each compressed matrix M of its fused gradient:

1. adds its residual: M += e (error feedback: nothing the approximation misses is lost,
   it arrives in a later step);
2. P = M Q, with Q (m x R) the last step's sum (at the first step a random matrix,
   the same on every worker: drawn from ``seed``);
3. sums P over the workers, in ONE allreduce with every matrix's P and the values that
   travel whole (biases, BatchNorm's vectors, matrices too small to gain) and the
   status tail;
4. makes P's columns orthonormal (Gram-Schmidt);
5. Q = M^T P, summed over the workers in a second allreduce (every matrix's Q);
6. takes P Q^T as the sum of the workers' M, and keeps e = M - P Q^T / workers.

A matrix is compressed only where that at least halves its values, (n + m) R <= n m / 2
(PyTorch's default rule); what is not compressed is summed exactly, as without
compression. Steps 4 and 6 start from the same sums on every worker, so every worker
gets the same bits (with the same numpy and BLAS: on a cluster of different CPUs the
replicas' checksums would catch a difference). The first ``warmup`` steps are exact
sums (the early gradients are large and change fast; PyTorch's ``start_powerSGD_iter``).

Not with ``--overlap`` (the factors need the whole gradient). In async training
(:class:`LowRankFeedback`) a worker's push carries the factors of its own gradient, one
power iteration a push, warm-started from its last Q; the server expands them. A sync
checkpoint carries every worker's residuals and Q (:attr:`PowerSGDEngine.state`), so a
resumed sync run is bit-exact with the uninterrupted one; an async worker starts again
from zero residuals and a new Q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .engines import WholeGradientEngine, seconds_of
from .pieces import Span, gather_whole, merge_whole, scatter_whole, variables_in

#: a matrix is compressed only if its factors are at most this fraction of its values
MOST_FACTOR_SHARE = 0.5
#: below this norm a column of P counts as zero (it is left zero, not divided by ~0)
TINY = 1e-8
#: a column of P whose part orthogonal to those before it is under this share of its
#: length is taken as dependent on them (float32 keeps about 7 digits)
DEPENDENT = 1e-3


@dataclass(frozen=True)
class Matrix:
    """A compressed variable (or its whole rows in a span): ``rows x cols`` values from
    ``at``."""

    at: int
    rows: int
    cols: int


def plan_matrices(shapes: Sequence[Tuple[int, ...]], rank: int, min_size: int = 0,
                  span: Optional[Span] = None) -> Tuple[List[Matrix], List[Span]]:
    """Which variables (``shapes``, in the fused buffer's order; only their parts in
    ``span``, None: all) travel as factors of ``rank``: (the matrices, the (start, end)
    spans that travel whole, adjacent ones merged; both relative to the span's start).
    A matrix of ``min_size`` values or more is compressed where its factors are at most
    MOST_FACTOR_SHARE of its values."""
    matrices: List[Matrix] = []
    whole: List[Span] = []
    for part in variables_in(shapes, span):
        if part.rows and part.size >= min_size and \
                (part.rows + part.cols) * rank <= MOST_FACTOR_SHARE * part.size:
            matrices.append(Matrix(part.at, part.rows, part.cols))
        else:
            merge_whole(whole, part)
    return matrices, whole


def orthonormalize_(p: np.ndarray) -> np.ndarray:
    """``p``'s columns made orthonormal in place, in order (Gram-Schmidt, twice: in
    float32 one pass leaves columns visibly non-orthogonal); a column that is (nearly) a
    combination of those before it (what is left of it under ``DEPENDENT`` of its
    length) is left zero, not blown up from rounding noise."""
    for _ in range(2):
        lengths = np.linalg.norm(p, axis=0)
        for i in range(p.shape[1]):
            column = p[:, i]
            norm = float(np.linalg.norm(column))
            if norm <= max(TINY, DEPENDENT * float(lengths[i])):
                column[:] = 0.0
                continue
            column /= norm
            rest = p[:, i + 1:]
            if rest.shape[1]:
                rest -= np.outer(column, column @ rest)
    return p


def _views(flat: np.ndarray, matrices: Sequence[Matrix], side: str, rank: int
           ) -> List[np.ndarray]:
    """Each matrix's factor (its ``side``, rows or cols, by ``rank``) in ``flat``."""
    views, at = [], 0
    for m in matrices:
        n = getattr(m, side)
        views.append(flat[at:at + n * rank].reshape(n, rank))
        at += n * rank
    return views


class _Factors:
    """The matrices of a plan, their residuals (one flat vector, so that a checkpoint
    takes them as one array) and the work on them common to both protocols."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], rank: int, min_size: int,
                 span: Optional[Span], sends: bool = True):
        self.rank = rank
        self.matrices, self.whole = plan_matrices(shapes, rank, min_size, span)
        self.n_p = sum(m.rows for m in self.matrices) * rank
        self.n_q = sum(m.cols for m in self.matrices) * rank
        self.n_whole = sum(end - start for start, end in self.whole)
        largest = max((m.rows * m.cols for m in self.matrices), default=0) if sends else 0
        # (an async server only decodes: no residual, no scratch)
        self.residual = np.zeros(sum(m.rows * m.cols for m in self.matrices) if sends else 0,
                                 np.float32)
        self.residuals = self._in(self.residual) if sends else []
        self._scratch = np.empty(largest, np.float32)

    def _in(self, flat: np.ndarray) -> List[np.ndarray]:
        views, at = [], 0
        for m in self.matrices:
            views.append(flat[at:at + m.rows * m.cols].reshape(m.rows, m.cols))
            at += m.rows * m.cols
        return views

    def p_views(self, flat: np.ndarray) -> List[np.ndarray]:
        return _views(flat, self.matrices, "rows", self.rank)

    def q_views(self, flat: np.ndarray) -> List[np.ndarray]:
        return _views(flat, self.matrices, "cols", self.rank)

    def matrices_of(self, values: np.ndarray) -> List[np.ndarray]:
        """Each matrix's values in ``values`` (the span's gradient), as views."""
        return [values[m.at:m.at + m.rows * m.cols].reshape(m.rows, m.cols)
                for m in self.matrices]

    def keep_missed(self, grads, ps, qs, share: float) -> None:
        """Each residual := its ``grad`` - P Q^T x ``share``, and ``grad`` := P Q^T."""
        factor = np.float32(share)
        for grad, residual, p, q in zip(grads, self.residuals, ps, qs):
            residual[:] = grad
            np.matmul(p, q.T, out=grad)
            scratch = self._scratch[:grad.size].reshape(grad.shape)
            np.multiply(grad, factor, out=scratch)
            residual -= scratch


class PowerSGDEngine(WholeGradientEngine):
    """An engine (:class:`~.engines.Engine`) moving the fused buffer's weight matrices as
    PowerSGD's factors through ``engine`` (two allreduces a step; see the module's
    docstring): the same contract, every worker gets the same sum, in place, of what
    the matrices approximate and of the rest exactly. ``shapes``: the gradient's
    variables in the fused buffer's order (``n_gradient`` values, then the status
    tail, up to ``size``). Warm-up and the rest: :class:`~.engines.WholeGradientEngine`.
    Collective over the workers, the same arguments on each."""

    title = "PowerSGD"

    def __init__(self, engine, shapes: Sequence[Tuple[int, ...]], n_gradient: int,
                 size: int, rank: int, min_size: int = 0, warmup: int = 0, seed: int = 0,
                 steps: int = 0):
        super().__init__(engine, n_gradient, size, warmup, steps)
        self.rank = rank
        self.factors = _Factors(shapes, rank, min_size, None)
        self.matrices, self.whole = self.factors.matrices, self.factors.whole
        #: the spans of the buffer that travel whole, beside the P's in the first sum
        self._beside_p = [*self.whole, (n_gradient, size)]
        self.compresses = bool(self.matrices)
        #: the first sum: every P, then what travels whole, then the status tail
        self.first = np.zeros(self.factors.n_p + self.factors.n_whole + size - n_gradient,
                              np.float32)
        #: the second sum: every Q (also the next step's warm start)
        self.second = np.random.default_rng(seed).standard_normal(self.factors.n_q,
                                                                  dtype=np.float32)
        self._p = self.factors.p_views(self.first)
        self._q = self.factors.q_views(self.second)

    @property
    def values_sent(self) -> int:
        """How many values a worker sends a step once compressing (both sums)."""
        return self.first.size + self.second.size

    @property
    def state(self) -> np.ndarray:
        """What a resumed run needs to continue bit-identically: this worker's residuals,
        then the warm start Q (the same on every worker); a copy."""
        return np.concatenate([self.factors.residual, self.second])

    def restore(self, state: np.ndarray) -> None:
        """Continue from :attr:`state` (of a plan of the same size)."""
        n = self.factors.residual.size
        self.factors.residual[:] = state[:n]
        self.second[:] = state[n:]

    def _compressed_sum_(self, buf: np.ndarray, what: str, kind: str,
                         computing: bool) -> float:
        grads = self.factors.matrices_of(buf)
        for grad, residual, p, q in zip(grads, self.factors.residuals, self._p, self._q):
            grad += residual
            np.matmul(grad, q, out=p)
        beside_p = self.first[self.factors.n_p:]
        gather_whole(buf, self._beside_p, beside_p)
        moving = seconds_of(self.engine.allreduce_sum_, self.first,
                            what=f"{what} (PowerSGD's P)", kind=kind, computing=computing)
        scatter_whole(beside_p, self._beside_p, buf)
        for grad, p, q in zip(grads, self._p, self._q):
            orthonormalize_(p)
            np.matmul(grad.T, p, out=q)
        moving += seconds_of(self.engine.allreduce_sum_, self.second,
                             what=f"{what} (PowerSGD's Q)", kind=kind, computing=computing)
        # the workers' sum, approximated, goes out; what it missed of this worker's part
        # (a 1 / workers share of the sum) stays
        self.factors.keep_missed(grads, self._p, self._q, 1.0 / self.size)
        return moving


class LowRankFeedback:
    """One async worker's PowerSGD codec for ``span`` of the fused gradient: each push
    carries, for each matrix M (plus its residual), P = orthonormal(M Q) and Q = M^T P,
    R (rows + cols) values, which the server expands to P Q^T; the worker keeps M - P Q^T
    as its residual and Q as the next push's warm start. No sum over workers: one
    worker's gradient, one power iteration, as in the sync step. :attr:`slots` float32
    a message: every P, every Q, then the values that travel whole. The same ``shapes``,
    ``rank``, ``min_size`` and ``span`` at both ends; ``sends``: the worker's end (the
    server's only decodes)."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], rank: int, min_size: int,
                 span: Optional[Span] = None, sends: bool = True, seed: int = 0):
        self.factors = _Factors(shapes, rank, min_size, span, sends)
        f = self.factors
        self.slots = f.n_p + f.n_q + f.n_whole
        self.warm = np.random.default_rng(seed).standard_normal(f.n_q if sends else 0,
                                                                dtype=np.float32)
        self._warm = f.q_views(self.warm) if sends else []

    def encode(self, values: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` (:attr:`slots`) := the message for ``values`` (the span's gradient) plus
        the residual; the residual keeps what the factors miss (a copy of ``values``'s
        matrices is made: ``values`` is left as it was)."""
        f = self.factors
        ps, qs = f.p_views(out[:f.n_p]), f.q_views(out[f.n_p:f.n_p + f.n_q])
        grads = f.matrices_of(values)
        for grad, residual, warm, p, q in zip(grads, f.residuals, self._warm, ps, qs):
            residual += grad  # the residual now holds M
            np.matmul(residual, warm, out=p)
            orthonormalize_(p)
            np.matmul(residual.T, p, out=q)
            scratch = f._scratch[:grad.size].reshape(grad.shape)
            residual -= np.matmul(p, q.T, out=scratch)
        self.warm[:] = out[f.n_p:f.n_p + f.n_q]
        gather_whole(values, f.whole, out[f.n_p + f.n_q:])
        return out

    def decode(self, message: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` (the span's float32 gradient) := what ``message`` carries."""
        f = self.factors
        ps, qs = f.p_views(message[:f.n_p]), f.q_views(message[f.n_p:f.n_p + f.n_q])
        for grad, p, q in zip(f.matrices_of(out), ps, qs):
            np.matmul(p, q.T, out=grad)
        scatter_whole(message[f.n_p + f.n_q:], f.whole, out)
        return out
