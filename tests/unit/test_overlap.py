"""The exchange plan and the background thread of --overlap, with a fake engine (pure
logic: the real exchange under MPI is in tests/mpi/test_sync_protocol.py and
tests/e2e/test_overlap_mpirun.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.errors import CommTimeout
from mpitrain.models.replica import bucket_bounds
from mpitrain.exchange import BucketedExchange, ErrorFeedback, Plan, overlap


@pytest.mark.parametrize("sizes,bucket_bytes,expected", [
    # last variables first; each bucket the fewest variables that make the size
    ([10, 20, 30], 4 * 30, [(30, 60), (0, 30)]),
    ([10, 20, 30], 4 * 31, [(10, 60), (0, 10)]),
    ([10, 20, 30], 4, [(30, 60), (10, 30), (0, 10)]),
    ([10, 20, 30], 4 * 1000, [(0, 60)]),  # all in one
    ([7840, 10], 40, [(7840, 7850), (0, 7840)]),  # LR: bias, then kernel
])
def test_buckets_cover_the_vector_in_back_propagation_order(sizes, bucket_bytes, expected):
    bounds = bucket_bounds(sizes, bucket_bytes)
    assert bounds == expected
    assert bounds[0][1] == sum(sizes) and bounds[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gap


class FakeReplica:
    """Fills its buffer in the order ``fill_order`` (as TensorFlow might), calling the
    exchange's callback per bucket; ``fail`` raises after the first bucket."""

    n_params = 6

    def __init__(self, fill_order, fail=False):
        self.fill_order, self.fail = fill_order, fail

    def bucketed_grad(self, bounds, tail, on_ready, out=None):
        buf = np.zeros(self.n_params + tail, np.float32) if out is None else out

        def grad(x, y, scale):
            for b in self.fill_order:
                lo, hi = bounds[b]
                buf[lo:hi] = np.arange(lo, hi) * scale
                on_ready(b)
                if self.fail:
                    raise RuntimeError("out of memory")
            return buf, 1.0, 2.0

        return grad, buf


class FakeEngine:
    """Records each allreduce (a copy of the segment and how it was called); doubles the
    values (the sum over two identical workers)."""

    def __init__(self, error=None):
        self.calls, self.error = [], error

    size = 2

    def allreduce_sum_(self, buf, at=0, *, what="", kind="allreduce", computing=False):
        self.calls.append((buf.copy(), what, computing, at))
        if self.error:
            raise self.error
        buf *= 2
        return buf

    def fused_buffer(self, size):
        return None




BOUNDS = [(4, 6), (2, 4), (0, 2)]


def exchange(replica, engine):
    return BucketedExchange(replica, engine, tail=2, scale=0.5, bounds=BOUNDS,
                            bound_seconds=5.0, me="rank 1 on vm")


@pytest.mark.parametrize("fill_order", [[0, 1, 2], [2, 1, 0], [1, 0, 2]])
def test_buckets_are_summed_in_their_order_whatever_order_they_are_filled(fill_order):
    engine = FakeEngine()
    ex = exchange(FakeReplica(fill_order), engine)
    for step in range(2):  # the thread serves step after step
        engine.calls.clear()
        buf, loss, norm = ex.grad(None, None)
        buf[6:] = [1.0, 3.0]  # the caller's status tail
        ex.allreduce_(buf)
        segments = [call[0] for call in engine.calls]
        # bucket 0 (the last variables) first, then the others, then the tail alone
        assert [s.tolist() for s in segments] == [[2.0, 2.5], [1.0, 1.5], [0.0, 0.5], [1.0, 3.0]]
        assert [call[2] for call in engine.calls] == [True, True, True, False]
        assert [call[3] for call in engine.calls] == [4, 2, 0, 6]  # where each part starts
        assert "bucket 1 of 3" in engine.calls[0][1]
        assert buf.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 2.0, 6.0]
    ex.close()


def test_a_failed_bucket_is_raised_in_the_callers_thread():
    ex = exchange(FakeReplica([0, 1, 2]), FakeEngine(CommTimeout("rank 1 waited 5 s")))
    buf, _, _ = ex.grad(None, None)
    with pytest.raises(CommTimeout, match="rank 1 waited 5 s"):
        ex.allreduce_(buf)
    ex.close()


def test_a_failed_step_stops_the_buckets_it_did_not_fill(monkeypatch):
    monkeypatch.setattr(overlap, "LOOK_EVERY", 0.01)
    engine = FakeEngine()
    ex = exchange(FakeReplica([0, 1, 2], fail=True), engine)
    with pytest.raises(RuntimeError, match="out of memory"):
        ex.grad(None, None)
    assert ex._done.wait(5.0)  # the thread gave up on buckets 1 and 2
    assert len(engine.calls) <= 1
    ex.close()
    ex._thread.join(5.0)
    assert not ex._thread.is_alive()


def test_the_callers_wait_is_bounded():
    ex = exchange(FakeReplica([0, 1, 2]), FakeEngine())
    ex.bound_seconds = 0.05
    ex._done.clear()  # as if the thread never finished
    with pytest.raises(CommTimeout, match=r"rank 1 on vm waited 0.05 s for the gradient "
                                          r"buckets' allreduce.*raise --timeout"):
        ex.allreduce_(np.zeros(8, np.float32))


@pytest.mark.parametrize("buckets,settings,bucketed", [
    (3, {}, True),  # auto: two buckets or more on the mpi engine
    (1, {}, False),  # one bucket: nothing to overlap
    (1, {"overlap": "on"}, True),
    (3, {"overlap": "off"}, False),
    (3, {"allreduce": "horovod"}, False),
    (3, {"compression": "fp16"}, True),
    (3, {"compiler": "xla"}, False),
])
def test_auto_overlaps_where_it_applies(buckets, settings, bucketed):
    from mpitrain.config import Config

    cfg = Config.of(model="alexnet", **settings)
    decided = Plan.of(cfg, BOUNDS[:buckets], SimpleNamespace(size=2, hosts=["a", "b"]))
    assert (decided.buckets == BOUNDS[:buckets]) if bucketed else decided.buckets is None


def test_fp16_parts_get_the_same_bits_and_residuals_as_the_whole():
    rng = np.random.default_rng(0)
    whole, parts = ErrorFeedback(1000), ErrorFeedback(1000)
    for _ in range(3):  # residuals carried from step to step
        grad = np.concatenate([rng.normal(size=1000), [1.0, 0.5, 2.0]]).astype(np.float32)
        expected = whole.encode(grad, np.zeros(1003, np.float16))
        got = np.zeros(1003, np.float16)
        for lo, hi in [(600, 1000), (0, 600), (1000, 1003)]:  # buckets, then the tail
            got[lo:hi] = parts.encode(grad[lo:hi], np.zeros(hi - lo, np.float16), at=lo)
        assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))
        assert np.array_equal(parts.residual, whole.residual)
