"""PowerSGD's arithmetic (mpitrain.exchange.powersgd), with workers as threads of this
process summing through a barrier: which variables travel as factors, the factors'
orthonormal columns, a low-rank sum recovered exactly, nothing lost to the
approximation (error feedback), the same bits on every worker. The engine under real
mpirun: tests/e2e/test_compression_mpirun.py."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.cli.commands import parse_config
from mpitrain.errors import UsageError
from mpitrain.exchange import Plan
from mpitrain.exchange.powersgd import Matrix, PowerSGDEngine, orthonormalize_, plan_matrices


class ThreadSum:
    """``size`` threads' engines: each call sums every thread's buffer, in rank order
    (the same bits on each), as an MPI allreduce would, or gathers them (an allgather;
    tests/unit/test_topk.py)."""

    def __init__(self, size: int):
        self.size, self.barrier, self.parts = size, threading.Barrier(size, timeout=30), {}

    def member(self, rank: int):
        group = self

        class Member:
            size = group.size

            def allreduce_sum_(self, buf, at=0, **_):
                group.parts[rank] = buf.copy()
                group.barrier.wait()
                total = group.parts[0].copy()
                for r in range(1, group.size):
                    total += group.parts[r]
                group.barrier.wait()  # every thread has its sum: the parts may change
                buf[:] = total
                return buf

            def allgather_(self, mine, out, **_):
                group.parts[rank] = mine.copy()
                group.barrier.wait()
                for r in range(group.size):
                    out[r] = group.parts[r]
                group.barrier.wait()
                return out

        return Member()


def run_workers(size: int, make_engine, steps: int, buffers):
    """Each worker thread sums ``buffers(rank, step)`` ``steps`` times through its engine;
    {rank: [each step's result]}, and the engines."""
    group, results = ThreadSum(size), {}
    engines = [make_engine(group.member(r)) for r in range(size)]

    def work(rank):
        results[rank] = [engines[rank].allreduce_sum_(buffers(rank, t).copy())
                         for t in range(steps)]

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == size, "a worker thread failed"
    return results, engines


def test_which_variables_travel_as_factors():
    # a 784x10 kernel at rank 2: (784 + 10) 2 = 1,588 <= 3,920 (half of 7,840): factors;
    # its bias, a 3x3x1x4 convolution (9 x 4: 52 > 18) and a 5x8 matrix (52 > 20) whole
    shapes = [(784, 10), (10,), (3, 3, 1, 4), (5, 8), (64, 32)]
    matrices, whole = plan_matrices(shapes, 2)
    assert matrices == [Matrix(0, 784, 10), Matrix(7926, 64, 32)]
    assert whole == [(7840, 7926)]  # the bias, the convolution and the 5x8, merged
    assert plan_matrices([(784, 10)], 5) == ([], [(0, 7840)])  # 7,940 > 3,920


def test_orthonormalize_makes_orthonormal_columns_and_zeroes_dependent_ones():
    p = np.random.default_rng(0).standard_normal((50, 3)).astype(np.float32)
    orthonormalize_(p)
    np.testing.assert_allclose(p.T @ p, np.eye(3), atol=1e-5)
    dependent = np.ones((4, 2), np.float32)  # the second column is the first again
    orthonormalize_(dependent)
    np.testing.assert_allclose(dependent[:, 0], 0.5)
    assert not dependent[:, 1].any()


def sizes_of(shapes):
    return sum(int(np.prod(s)) for s in shapes)


SHAPES = [(60, 12), (12,), (30, 20)]
TAIL = 3


def test_a_low_rank_sum_is_recovered_and_the_rest_summed_exactly():
    """Workers whose kernels are multiples of one rank-1 matrix: their sum is rank 1,
    which rank 2 recovers after one step (up to float32 rounding); the bias and the
    status tail are exact sums."""
    rng = np.random.default_rng(1)
    u, v = rng.standard_normal(60), rng.standard_normal(12)
    n = sizes_of(SHAPES)

    def buffer(rank, step):
        buf = np.zeros(n + TAIL, np.float32)
        buf[:720] = (np.outer(u, v) * (rank + 1)).reshape(-1)
        buf[720:732] = rank + 0.25  # the bias
        buf[732:n] = 0.0  # the second matrix: zero
        buf[n:] = [1.0, rank, 2.5]
        return buf

    results, engines = run_workers(3, lambda e: PowerSGDEngine(e, SHAPES, n, n + TAIL, 2),
                                   1, buffer)
    out = results[0][0]
    np.testing.assert_allclose(out[:720].reshape(60, 12), 6 * np.outer(u, v), rtol=1e-4,
                               atol=1e-4)
    assert (out[720:732] == 0.25 + 1.25 + 2.25).all()
    assert out[n:].tolist() == [3.0, 3.0, 7.5]
    for rank in (1, 2):  # the same bits on every worker
        assert results[rank][0].tobytes() == out.tobytes()
    assert engines[0].values_sent < n  # fewer values than the gradient's


def test_nothing_is_lost_what_the_factors_miss_arrives_later():
    """Full-rank gradients, the same every step: after T steps, what went out plus what
    the workers still hold (their residuals, each its part: already divided by the
    workers) is T times the true sum (error feedback loses nothing), and with the
    residuals going out step by step the average per step approaches the true sum."""
    rng = np.random.default_rng(2)
    n, workers, steps = sizes_of(SHAPES), 2, 60
    grads = [rng.standard_normal(n + TAIL).astype(np.float32) for _ in range(workers)]
    for g in grads:
        g[n:] = 0.0
    true_sum = grads[0] + grads[1]
    results, engines = run_workers(workers, lambda e: PowerSGDEngine(e, SHAPES, n, n + TAIL, 2),
                                   steps, lambda rank, step: grads[rank])
    sent = np.sum(results[0], axis=0, dtype=np.float64)
    held = sum(np.concatenate([r.reshape(-1) for r in e.factors.residuals]) for e in engines)
    matrix_values = np.r_[0:720, 732:n]
    np.testing.assert_allclose(sent[matrix_values] + held, steps * true_sum[matrix_values],
                               rtol=1e-3, atol=2e-2)
    np.testing.assert_allclose(sent[720:732], steps * true_sum[720:732], rtol=1e-5)
    one_step = np.abs(results[0][0][matrix_values] - true_sum[matrix_values]).mean()
    averaged = np.abs(sent[matrix_values] / steps - true_sum[matrix_values]).mean()
    assert averaged < one_step / 5, (averaged, one_step)  # the misses caught up with


def test_warmup_steps_are_exact_sums():
    n = sizes_of(SHAPES)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(n + TAIL).astype(np.float32) for _ in range(2)]
    results, _ = run_workers(2, lambda e: PowerSGDEngine(e, SHAPES, n, n + TAIL, 2, warmup=2),
                             3, lambda rank, step: grads[rank])
    exact = grads[0] + grads[1]
    assert results[0][0].tobytes() == exact.tobytes() == results[0][1].tobytes()
    assert results[0][2].tobytes() != exact.tobytes()  # the third step compresses


def test_buckets_are_refused():
    n = sizes_of(SHAPES)
    engine = PowerSGDEngine(ThreadSum(1).member(0), SHAPES, n, n + TAIL, 2)
    with pytest.raises(ValueError, match="whole fused buffer"):
        engine.allreduce_sum_(np.zeros(100, np.float32), at=100)


def test_the_rules_of_the_options():
    cfg = parse_config(["lr", "--compression", "powersgd", "--compression-rank", "4",
                        "--compression-warmup-steps", "10"], world_size=3)
    assert (cfg.transport.compression_rank, cfg.transport.compression_warmup) == (4, 10)
    # never buckets (the factors need the whole gradient), never shared memory
    decided = Plan.of(cfg, [(0, 10), (10, 7850)], SimpleNamespace(size=2, hosts=["a", "a"]))
    assert (decided.engine, decided.compression, decided.buckets) == ("mpi", "powersgd", None)
    for argv, error in (
            (["--compression-rank", "4"], "--compression-rank is for --compression "
                                          "powersgd: add --compression powersgd"),
            (["--compression-warmup-steps", "5"], "--compression-warmup-steps is for "
                                                  "--compression powersgd or topk"),
            (["--compression", "topk", "--compression-rank", "4"], "add --compression "
                                                                   "powersgd"),
            (["--compression", "powersgd", "--compression-ratio", "0.1"], "add --compression "
                                                                          "topk"),
            (["--compression", "fp16", "--compression-min-size", "10"], "is for --compression "
                                                                        "powersgd or topk"),
            (["--compression", "topk", "--compression-ratio", "0.5"],
             "--compression-ratio must be"),
            (["--compression", "powersgd", "--async", "--compression-warmup-steps", "5"],
             "async pushes have a fixed length"),
            (["--compression", "powersgd", "--allreduce", "horovod"], "use --allreduce mpi"),
            (["--compression", "topk", "--overlap", "on"], "drop --overlap on"),
            (["--compression", "powersgd", "--compression-rank", "0"],
             "--compression-rank must be")):
        with pytest.raises(UsageError, match=error):
            parse_config(["lr", *argv], world_size=3)
