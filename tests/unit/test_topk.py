"""Top-k sparsification (mpitrain.exchange.topk), the variables' parts in a span
(mpitrain.exchange.pieces) and the async push codecs of topk and powersgd, with sync
workers as threads of this process (test_powersgd's ThreadSum). Under real mpirun:
tests/mpi/test_sync_protocol.py and tests/e2e/test_compression_mpirun.py."""

import numpy as np
import pytest

from test_powersgd import ThreadSum, run_workers, sizes_of

from mpitrain.config.sections import TransportSettings
from mpitrain.exchange.pieces import Part, variables_in
from mpitrain.exchange.powersgd import LowRankFeedback
from mpitrain.exchange.topk import Sparse, TopKEngine, TopKFeedback, plan_sparse, top_k
from mpitrain.train.asynchronous.mailbox import PushCodec

SHAPES = [(60, 12), (12,), (30, 20)]
TAIL = 3


def test_a_span_keeps_a_cut_matrix_s_whole_rows_as_a_matrix():
    # (4, 5) at 0..20, (3,) at 20..23, (6, 2) at 23..35; the span 7..29 cuts both matrices
    parts = list(variables_in([(4, 5), (3,), (6, 2)], (7, 29)))
    assert parts == [Part(0, 3, 0, 0),  # 7..10: the rest of row 1
                     Part(3, 10, 2, 5),  # 10..20: rows 2 and 3
                     Part(13, 3, 0, 0),  # the vector
                     Part(16, 6, 3, 2)]  # 23..29: three whole rows
    assert list(variables_in([(4, 5)], (6, 9))) == [Part(0, 3, 0, 0)]  # inside one row
    assert [p.size for p in variables_in(SHAPES)] == [720, 12, 600]


def test_which_variables_are_sparsified():
    # 1% of 720 is 8 (16 <= 360: yes); the bias is under the minimum size; 1% of 600 is 6
    sparse, whole = plan_sparse(SHAPES, 0.01, 100)
    assert sparse == [Sparse(0, 720, 8), Sparse(732, 600, 6)] and whole == [(720, 732)]
    sparse, whole = plan_sparse(SHAPES, 0.01, 700)  # only the first is large enough
    assert sparse == [Sparse(0, 720, 8)] and whole == [(720, 1332)]
    assert plan_sparse(SHAPES, 0.3, 0) == ([], [(0, 1332)])  # pairs over half: whole


@pytest.mark.parametrize("n,k", [(10, 3), (5000, 50), (200_000, 2_000), (200_000, 1)])
def test_top_k_finds_exactly_the_k_largest(n, k):
    rng = np.random.default_rng(n + k)
    magnitudes = np.abs(rng.standard_normal(n)).astype(np.float32)
    chosen = top_k(magnitudes, k)
    assert len(set(chosen.tolist())) == k
    assert magnitudes[chosen].min() >= np.sort(magnitudes)[-k]


def test_top_k_falls_back_where_the_sample_misleads():
    # the large values sit between the sampled ones: the sample's threshold keeps too
    # few, and the full partition must find them
    magnitudes = np.zeros(97 * 1000, np.float32)
    magnitudes[1::97] = 1.0
    magnitudes[0::97] = 0.5
    chosen = top_k(magnitudes, 1000)
    assert (magnitudes[chosen] == 1.0).all()


def test_error_feedback_loses_nothing_and_the_message_decodes_to_what_was_sent():
    rng = np.random.default_rng(0)
    n = sizes_of(SHAPES)
    codec = TopKFeedback(SHAPES, 0.05, 100)
    server = TopKFeedback(SHAPES, 0.05, 100, sends=False)
    message = np.zeros(codec.slots, np.float32)
    given, arrived = np.zeros(n), np.zeros(n)
    out = np.full(n, np.nan, np.float32)
    for _ in range(40):
        grad = rng.standard_normal(n).astype(np.float32)
        given += grad
        arrived += server.decode(codec.encode(grad, message), out)
        assert np.count_nonzero(out[:720]) <= 36 and np.count_nonzero(out[732:]) <= 30
        np.testing.assert_array_equal(out[720:732], grad[720:732])  # the bias: whole
    held = np.zeros(n)
    held[:720], held[732:] = codec.residual[:720], codec.residual[720:]
    np.testing.assert_allclose(arrived + held, given, atol=1e-4)
    assert codec.slots == 2 * (36 + 30) + 12 and server.residual.size == 0


def test_each_message_sends_the_largest_values_of_gradient_plus_residual():
    codec = TopKFeedback([(100,)], 0.1, 0)
    grad = np.arange(100, dtype=np.float32) - 50  # largest magnitudes: -50..-46, 45..49
    message = codec.encode(grad, np.zeros(codec.slots, np.float32))
    assert sorted(message[10:20].tolist()) == [-50, -49, -48, -47, -46, 45, 46, 47, 48, 49]
    again = codec.encode(np.zeros(100, np.float32), np.zeros(codec.slots, np.float32))
    # then, with nothing new, the next largest it held: -45..-41 and 40..44
    assert sorted(again[10:20].tolist()) == [-45, -44, -43, -42, -41, 40, 41, 42, 43, 44]


def test_the_sync_engine_sums_every_worker_s_selection_with_the_same_bits():
    n = sizes_of(SHAPES)
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(n + TAIL).astype(np.float32) for _ in range(3)]
    for r, g in enumerate(grads):
        g[n:] = [0.0, r, 1.5]
    results, engines = run_workers(
        3, lambda e: TopKEngine(e, SHAPES, n, n + TAIL, 0.05, 100), 2,
        lambda rank, step: grads[rank])
    references = [TopKFeedback(SHAPES, 0.05, 100) for _ in range(3)]
    expected = np.zeros(n, np.float32)
    for step in range(2):
        expected[:] = 0.0
        for reference, g in zip(references, grads):  # each worker's message, in rank order
            message = reference.encode(g[:n], np.zeros(reference.slots, np.float32))
            reference.add_to(message, expected)
        assert results[0][step][:n].tobytes() == expected.tobytes()
        assert results[0][step][n:].tolist() == [0.0, 3.0, 4.5]
        for r in (1, 2):
            assert results[r][step].tobytes() == results[0][step].tobytes()
    assert engines[0].values_sent == 2 * (36 + 30) + 12 + TAIL


def test_the_sync_engine_s_warm_up_is_exact_and_counts_from_a_resumed_step():
    n = sizes_of(SHAPES)
    grads = [np.random.default_rng(r).standard_normal(n + TAIL).astype(np.float32)
             for r in range(2)]
    results, _ = run_workers(2, lambda e: TopKEngine(e, SHAPES, n, n + TAIL, 0.05, 100,
                                                     warmup=3, steps=1),
                             3, lambda rank, step: grads[rank])
    exact = grads[0] + grads[1]
    assert results[0][0].tobytes() == exact.tobytes() == results[0][1].tobytes()
    assert results[0][2].tobytes() != exact.tobytes()  # step 4: compressed


def test_buckets_are_refused():
    n = sizes_of(SHAPES)
    engine = TopKEngine(ThreadSum(1).member(0), SHAPES, n, n + TAIL, 0.05, 100)
    with pytest.raises(ValueError, match="whole fused buffer"):
        engine.allreduce_sum_(np.zeros(100, np.float32), at=100)


def test_an_async_powersgd_push_recovers_a_low_rank_gradient_and_keeps_the_rest():
    rng = np.random.default_rng(5)
    n = sizes_of(SHAPES)
    worker = LowRankFeedback(SHAPES, 2, 100)
    server = LowRankFeedback(SHAPES, 2, 100, sends=False)
    grad = rng.standard_normal(n).astype(np.float32)
    grad[:720] = np.outer(rng.standard_normal(60), rng.standard_normal(12)).reshape(-1)
    out = server.decode(worker.encode(grad, np.zeros(worker.slots, np.float32)),
                        np.zeros(n, np.float32))
    np.testing.assert_allclose(out[:720], grad[:720], atol=1e-4)  # rank 1: recovered
    np.testing.assert_array_equal(out[720:732], grad[720:732])  # the bias: whole
    # the 30 x 20 matrix is full rank: what rank 2 misses is the residual, nothing lost
    np.testing.assert_allclose(out[732:] + worker.factors.residual[720:], grad[732:],
                               atol=1e-5)
    assert worker.slots == (60 + 12 + 30 + 20) * 2 + 12 < n
    assert server.factors.residual.size == 0 and server.warm.size == 0


@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_a_push_to_one_of_several_servers_carries_its_share_compressed(compression):
    # a share that cuts both matrices: their whole rows compress, the cut rows travel whole
    n = sizes_of(SHAPES)
    transport = TransportSettings(compression=compression, compression_ratio=0.05,
                                  compression_min_size=100)
    span = (40, 1000)
    worker = PushCodec(transport, SHAPES, span, sends=True)
    server = PushCodec(transport, SHAPES, span, sends=False)
    grad = np.random.default_rng(6).standard_normal(n).astype(np.float32)[40:1000]
    slots = np.zeros(worker.slots, np.float32)
    worker.encode(grad, slots)
    decoded = server.decode(slots)
    assert decoded.shape == (960,) and worker.slots < 960 / 2
    # the cut rows arrive whole: the first matrix's 40..48, the second's 992..1000
    np.testing.assert_array_equal(decoded[:8], grad[:8])
    np.testing.assert_array_equal(decoded[-8:], grad[-8:])
    residual = worker.coder.residual if compression == "topk" else worker.coder.factors.residual
    assert residual.size and np.abs(residual).sum() > 0
