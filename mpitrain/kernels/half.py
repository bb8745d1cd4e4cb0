"""float32 <-> float16 for gradient compression (``--compression fp16``): one fused pass
each, in C with the x86 F16C instructions (``mpitrain/kernels/_half.c``, built by ``pip install``)
where it was built and the CPU has them, in numpy otherwise. Both round to nearest even
(IEEE), so they give the same bits; numpy converts float16 one value at a time, about
an order of magnitude slower (docs/architecture.md, "float16 conversions in C").

A leaf: numpy only, no other part of mpitrain.
"""

from __future__ import annotations

import numpy as np

try:
    from . import _half  # type: ignore[attr-defined]  # (C: no types)
except ImportError:  # not built (no compiler at install time): numpy does it
    _half = None

#: True when the compiled F16C path is used
FAST = bool(_half is not None and _half.supported())


def widen_(half: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` (float32) := ``half`` (float16), same length."""
    (_half.widen if FAST else _widen_numpy)(half, out)
    return out


def encode_(values: np.ndarray, residual: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:n]`` := float16(values[:n] + residual) and ``residual`` := what that cast
    lost, with ``n = len(residual)`` (error feedback); ``out`` is float16."""
    (_half.encode if FAST else _encode_numpy)(values, residual, out)
    return out


def mean_rows_(rows: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """``out`` (float16) := float16(scale x the sum of the float16 ``rows`` (k, n)), summed
    in float32 in row order."""
    if FAST:
        _half.mean_rows(rows, rows.shape[0], float(scale), out)
    else:
        _mean_rows_numpy(rows, scale, out)
    return out


# ---- the numpy versions (also what the tests compare the compiled ones with) ------------
def _widen_numpy(half, out):
    out[:] = half


def _encode_numpy(values, residual, out):
    n = residual.size
    total = values[:n] + residual
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float16: inf, as in C
        out[:n] = total
        np.subtract(total, out[:n], out=residual)


def _mean_rows_numpy(rows, scale, out):
    total = rows[0].astype(np.float32)
    for row in rows[1:]:  # in row order, as the compiled loop adds them
        total += row
    total *= np.float32(scale)
    out[:] = total
