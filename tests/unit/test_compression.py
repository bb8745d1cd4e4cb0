"""fp16 gradient compression's pure parts: error feedback, the async push codec and the
sync engine wrapper (with a stand-in engine; the real exchange is in tests/mpi)."""

import numpy as np
import pytest

from mpitrain.kernels import half

from mpitrain.exchange import ErrorFeedback, HalfPrecisionEngine
from mpitrain.config.sections import TransportSettings
from mpitrain.train.asynchronous.mailbox import PushCodec

FP16, NONE = TransportSettings(compression="fp16"), TransportSettings()


def push_codec(transport, n, sends):
    return PushCodec(transport, [(n,)], (0, n), sends)


def test_error_feedback_loses_nothing_only_delays_it():
    rng = np.random.default_rng(0)
    feedback = ErrorFeedback(1000)
    out = np.zeros(1000, np.float16)
    sent = np.zeros(1000, np.float64)
    given = np.zeros(1000, np.float64)
    for _ in range(50):
        grad = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
        feedback.encode(grad, out)
        sent += out
        given += grad
    # what was sent plus what is still held back is exactly what was given
    np.testing.assert_allclose(sent + feedback.residual, given, rtol=0, atol=1e-9)
    assert np.abs(feedback.residual).max() < 1e-6  # never more than one cast's rounding


def test_values_too_small_for_float16_still_arrive_over_steps():
    feedback = ErrorFeedback(1)
    out = np.zeros(1, np.float16)
    tiny = np.array([1e-8], np.float32)  # below float16's smallest subnormal (6e-8)
    arrived = 0.0
    for _ in range(20):
        feedback.encode(tiny, out)
        arrived += float(out[0])
    assert arrived > 0 and abs(arrived - 20 * 1e-8) < 6e-8


def test_the_status_tail_is_cast_but_not_compensated():
    feedback = ErrorFeedback(2)
    out = np.zeros(4, np.float16)
    feedback.encode(np.array([0.1, 0.2, 1.0, np.nan], np.float32), out)
    assert out[2] == 1.0 and np.isnan(out[3]) and feedback.residual.size == 2


def test_a_push_carries_its_gradient_in_half_the_slots():
    codec = push_codec(FP16, 7, sends=True)
    assert codec.slots == 4
    slots = np.zeros(codec.slots, np.float32)
    grad = np.linspace(-1, 1, 7).astype(np.float32)
    codec.encode(grad, slots)
    decoded = push_codec(FP16, 7, sends=False).decode(slots)  # the server's own codec
    assert decoded.dtype == np.float32 and decoded.shape == (7,)
    np.testing.assert_allclose(decoded, grad, atol=1e-3)
    np.testing.assert_array_equal(decoded + codec.coder.feedback.residual, grad)


def test_without_compression_a_push_is_the_gradient_itself():
    codec = push_codec(NONE, 5, sends=True)
    slots = np.zeros(codec.slots, np.float32)
    codec.encode(np.arange(5, dtype=np.float32), slots)
    assert codec.slots == 5 and codec.coder is None
    np.testing.assert_array_equal(codec.decode(slots), np.arange(5))


class _Echo:
    """An engine of two workers, the other sending zeros: the sum is the buffer."""

    size = 2

    def allreduce_sum_half_(self, half, out, what, kind):
        out[:] = half[:out.size]
        return out


def test_the_sync_engine_moves_the_fused_buffer_as_float16_with_feedback():
    engine = HalfPrecisionEngine(_Echo(), n_gradient=3, size=5)
    assert engine.half.size == 6 and engine.half.dtype == np.float16  # padded to 2 segments
    buf = np.array([0.1, 1e-8, 3.0, 1.0, 0.25], np.float32)
    engine.allreduce_sum_(buf)
    assert buf.dtype == np.float32 and buf[3] == 1.0 and buf[4] == 0.25
    assert buf[1] == 0.0 and engine.feedback.residual[1] == np.float32(1e-8)
    assert buf[0] == np.float32(np.float16(0.1))


@pytest.mark.skipif(not half.FAST, reason="the compiled F16C path is not built or the CPU "
                                          "lacks F16C: numpy is the only path")
def test_the_compiled_conversions_give_numpys_bits():
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.standard_normal(1001) * 1e-3, [1e-8, -3e-7, 7e4, -1e5,
                                                                 np.inf, np.nan, 0.0, -0.0],
                             rng.standard_normal(37)]).astype(np.float32)
    residual = (rng.standard_normal(values.size) * 1e-6).astype(np.float32)
    outs = []
    for encode in (half._half.encode, half._encode_numpy):
        out, kept = np.zeros(values.size, np.float16), residual.copy()
        encode(values, kept, out)
        outs.append((out.view(np.uint16).copy(), kept.view(np.uint32).copy()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    rows = (rng.standard_normal((3, 517)) * 10).astype(np.float16)
    means = [np.zeros(517, np.float16), np.zeros(517, np.float16)]
    half._half.mean_rows(rows, 3, 1 / 3, means[0])
    half._mean_rows_numpy(rows, 1 / 3, means[1])
    np.testing.assert_array_equal(means[0].view(np.uint16), means[1].view(np.uint16))
    wide = [np.zeros(517, np.float32), np.zeros(517, np.float32)]
    half._half.widen(rows[0], wide[0])
    half._widen_numpy(rows[0], wide[1])
    np.testing.assert_array_equal(wide[0], wide[1])


def test_the_compiled_conversions_refuse_buffers_of_the_wrong_size():
    if not half.FAST:
        pytest.skip("the compiled F16C path is not built here")
    with pytest.raises(ValueError, match="differ in length"):
        half._half.widen(np.zeros(4, np.float16), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="k rows"):
        half._half.mean_rows(np.zeros(7, np.float16), 2, 0.5, np.zeros(3, np.float16))
