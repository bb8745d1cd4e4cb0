"""fp16 gradient compression's pure parts: error feedback, the async push codec and the
sync engine wrapper (with a stand-in engine; the real exchange is in tests/mpi)."""

import numpy as np

from mpitrain.train.compression import ErrorFeedback, HalfPrecisionEngine, PushCodec


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
    codec = PushCodec("fp16", 7)
    assert codec.slots == 4
    slots = np.zeros(codec.slots, np.float32)
    grad = np.linspace(-1, 1, 7).astype(np.float32)
    codec.encode(grad, slots)
    decoded = PushCodec("fp16", 7).decode(slots)  # the server's own codec
    assert decoded.dtype == np.float32 and decoded.shape == (7,)
    np.testing.assert_allclose(decoded, grad, atol=1e-3)
    np.testing.assert_array_equal(decoded + codec.feedback.residual, grad)


def test_without_compression_a_push_is_the_gradient_itself():
    codec = PushCodec("none", 5)
    slots = np.zeros(codec.slots, np.float32)
    codec.encode(np.arange(5, dtype=np.float32), slots)
    assert codec.slots == 5 and codec.feedback is None
    np.testing.assert_array_equal(codec.decode(slots), np.arange(5))


class _Echo:
    """An engine of one worker: the mean of one buffer is the buffer."""

    def allreduce_mean_half_(self, half, out, what, kind):
        out[:] = half
        return out


def test_the_sync_engine_moves_the_fused_buffer_as_float16_with_feedback():
    engine = HalfPrecisionEngine(_Echo(), n_gradient=3, size=5, workers=2)
    assert engine.half.size == 6 and engine.half.dtype == np.float16  # padded to 2 segments
    buf = np.array([0.1, 1e-8, 3.0, 1.0, 0.25], np.float32)
    engine.allreduce_mean_(buf)
    assert buf.dtype == np.float32 and buf[3] == 1.0 and buf[4] == 0.25
    assert buf[1] == 0.0 and engine.feedback.residual[1] == np.float32(1e-8)
    assert buf[0] == np.float32(np.float16(0.1))
