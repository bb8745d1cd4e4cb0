"""Momentum under asynchrony (``--momentum-correction``): the server's optimizer keeps
only the momentum that the asynchrony of its workers does not already add.

Mitliagkas, Zhang, Hadjis and Ré (2016, "Asynchrony begets momentum, with an
application to deep learning") show that with N workers whose gradients are applied
as they arrive, asynchronous SGD behaves in expectation like momentum SGD with
momentum 1 - 1/N. An optimizer's own momentum (momentum SGD's 0.9, Adam's beta_1)
comes on top of it, so the total grows with the cluster and overshoots; they tune
the explicit momentum down as N grows. The server's optimizer gets

    max(0, m - (1 - 1/N))

for its momentum m: with 0.9, 0.4 at 2 workers, 0.15 at 4, none from 10 workers. N
counts the workers that compute at once: under a staleness bound K, at most K + 1 (the
default bound of 4 at more than 5 workers: N = 5, 0.1). The workers compute gradients
only; they hold no optimizer, so nothing changes on them.

Momentum SGD's step builds up to lr / (1 - m) (a gradient's total effect on the
weights); asynchrony's implicit momentum does not change it (an update of rate lr per
push, as Mitliagkas et al.'s expectation shows). Lowering m alone would shrink that step
(0.1 / (1 - 0.4) against 0.1 / (1 - 0.9) at 2 workers), so for momentum SGD (plain or
Nesterov) the server's rate rises by (1 - m') / (1 - m) with the lowered m': the same
long-run step as the sync run of the same settings. Adam's step is the rate whatever its
beta_1 (the moment is an average, not a sum), so its rate stays.
Measured effect: docs/scaling.md.

Contract: every server of a run (``--servers K``) computes the same value from the
run's config, so every share of the parameters is updated alike; a run resumed onto
another number of workers gets that number's value (the optimizer's slots carry over
unchanged).
"""

from __future__ import annotations

from typing import Optional

from ...models import optim


def corrected(momentum: float, n_workers: int) -> float:
    """``momentum`` less the implicit momentum of ``n_workers`` asynchronous workers,
    1 - 1/N, and never below zero."""
    return max(0.0, momentum - (1.0 - 1.0 / max(1, n_workers)))


def server_momentum(cfg) -> Optional[float]:
    """The momentum of an async server's optimizer for ``cfg`` (a resolved Config):
    None leaves the optimizer its own (--momentum-correction off, or an optimizer
    without momentum)."""
    own = optim.MOMENTUM.get(cfg.optimizer.name)
    if own is None or cfg.asynchronous.momentum_correction == "off":
        return None
    return corrected(own, concurrent_workers(cfg))


def server_rate_factor(cfg) -> float:
    """The factor of an async server's learning rate that keeps momentum SGD's long-run
    step lr / (1 - m) where :func:`server_momentum` lowered m; 1 where it did not, and
    for Adam."""
    lowered = server_momentum(cfg)
    if lowered is None or cfg.optimizer.name == "adam":
        return 1.0
    return (1.0 - lowered) / (1.0 - optim.MOMENTUM[cfg.optimizer.name])


def described_server_momentum(cfg) -> str:
    """For the run line: ", server momentum M at lr R (...)", or "" if not lowered."""
    momentum = server_momentum(cfg)
    if momentum is None:
        return ""
    factor = server_rate_factor(cfg)
    rate = "" if factor == 1.0 else \
        f" at lr {cfg.effective_lr * factor:.3g} (the same long-run step)"
    return f", server momentum {momentum:.3g}{rate}"


def concurrent_workers(cfg) -> int:
    """The workers that compute at once: all of them, or at most K + 1 under a staleness
    bound K (:class:`mpitrain.train.leases.Leases`)."""
    bound = cfg.staleness_bound
    return cfg.workers if bound is None else min(cfg.workers, bound + 1)
