"""mpitrain.horovod's calls, each checked against the value it must give at ANY process
count (MPI tier: plain pytest runs them at one rank, tests/e2e/test_mpi_tier.py under
mpirun -np 2, 3, 4, in the launch the other MPI-tier tests share).

Rank r contributes values made from r + 1, so the expected result of every
collective is known in closed form for n ranks. Every rank runs the same tests in
the same order; where a check is about what every rank got, the ranks gather it.
"""

import math
import zlib

import numpy as np
import pytest

import mpitrain.horovod as hvd
import mpitrain.horovod.keras as hvdk
from mpitrain.horovod.collectives import Mismatch
from mpitrain.horovod.world import NotInitialized, Unsupported

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init(timeout=60)
    yield
    hvd.barrier()


def n():
    return hvd.size()


def me():
    return hvd.rank() + 1.0  # this rank's contribution


def same_everywhere(value) -> bool:
    """Whether every rank holds the same ``value`` (bytes of arrays compared)."""
    digest = zlib.crc32(np.ascontiguousarray(value).tobytes())
    return len(set(hvd.allgather_object(digest))) == 1


def test_topology():
    size, rank = hvd.size(), hvd.rank()
    assert 0 <= rank < size and hvd.is_initialized() and hvd.mpi_threads_supported()
    hosts = hvd.allgather_object(__import__("platform").node())
    assert hvd.local_size() == hosts.count(hosts[rank])
    assert hvd.local_rank() == hosts[:rank].count(hosts[rank])
    assert hvd.cross_size() == len(set(hosts)) and hvd.is_homogeneous() is not None
    assert int(hvd.size_op()) == size and int(hvd.rank_op()) == rank
    assert hvd.mpi_built() and not hvd.nccl_built() and not hvd.gloo_enabled()


def test_allreduce_ops_eagerly_and_in_a_graph():
    base = np.array([1.0, 2.0, 3.0])
    x = tf.constant(base, tf.float32) * me()
    total = n() * (n() + 1) / 2
    expected = {hvd.Average: base * total / n(), hvd.Sum: base * total, hvd.Min: base,
                hvd.Max: base * n(), hvd.Product: base ** n() * math.factorial(n())}

    @tf.function
    def in_graph(t):
        return [hvd.allreduce(t, op=op) for op in expected]

    for results in ([hvd.allreduce(x, op=op) for op in expected], in_graph(x)):
        for got, want in zip(results, expected.values()):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    # float16, every op (MPI has no float16 min, max or product)
    for op, want in expected.items():
        got = hvd.allreduce(tf.cast(x, tf.float16), op=op)
        assert got.dtype == tf.float16
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-3)
    # Horovod's scaling: prescale before, postscale after the sum
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    np.testing.assert_allclose(got.numpy(), np.array([1.0, 2.0, 3.0]) * total / 2, rtol=1e-6)
    # average=False is the old spelling of Sum; a scalar, eagerly and in a graph (where it
    # reaches numpy as a numpy scalar); Adasum is not provided
    assert hvd.allreduce(tf.constant(me()), average=False).numpy() == total
    assert tf.function(lambda: hvd.allreduce(tf.constant(me())))().numpy() == total / n()
    with pytest.raises(Unsupported, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)


def test_allreduce_dtypes():
    # integers: Average truncates as Horovod's (double scaling, truncated)
    got = hvd.allreduce(tf.constant([7, -7], tf.int32) * int(me()), op=hvd.Average)
    total = 7 * n() * (n() + 1) // 2
    assert got.dtype == tf.int32 and got.numpy().tolist() == [int(total / n()),
                                                              int(-total / n())]
    assert hvd.allreduce(tf.constant([3], tf.int64), op=hvd.Sum).numpy()[0] == 3 * n()
    for dtype in (tf.float16, tf.float64, tf.bfloat16):
        got = hvd.allreduce(tf.cast(tf.fill([5], me()), dtype), op=hvd.Sum)
        assert got.dtype == dtype and float(got[0]) == n() * (n() + 1) / 2
    flags = hvd.allreduce(tf.constant([hvd.rank() == 0, True]), op=hvd.Max)
    assert flags.numpy().tolist() == [True, True]
    # fp16 compression: float32 in and out, float16 on the wire
    got = hvd.allreduce(tf.fill([4], me() / 3), compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), (n() + 1) / 6, rtol=1e-3)


def test_powersgd_and_topk_compressions_replace_the_sum():
    """Compression.powersgd recovers a sum of rank 1 (every rank's matrix a multiple of
    one) from rank-2 factors; Compression.topk sends each rank's largest 10% and keeps the
    rest, so over steps the sums approach the exact one; both give every rank the same
    bits, eagerly and in a graph (a DistributedGradientTape), the bias whole."""
    u, v = np.arange(1.0, 41.0), np.linspace(-1, 1, 30)
    matrix = tf.constant(np.outer(u, v) * me(), tf.float32)
    bias = tf.fill([30], me())
    psgd = hvd.Compression.powersgd(rank=2, warmup_steps=0, min_size=100)
    got = hvd.grouped_allreduce([matrix, bias], op=hvd.Sum, compression=psgd)
    total = n() * (n() + 1) / 2
    np.testing.assert_allclose(got[0].numpy(), np.outer(u, v) * total, rtol=1e-3, atol=1e-3)
    assert np.all(got[1].numpy() == total) and same_everywhere(got[0].numpy())
    topk = hvd.Compression.topk(ratio=0.1, warmup_steps=0, min_size=100)
    noise = np.random.default_rng(hvd.rank()).standard_normal((40, 30)).astype(np.float32)
    exact = sum(np.random.default_rng(r).standard_normal((40, 30)).astype(np.float32)
                for r in range(n())) / n()
    sent = [hvd.allreduce(tf.constant(noise), compression=topk).numpy() for _ in range(20)]
    first_error = np.abs(sent[0] - exact).mean()
    assert np.count_nonzero(sent[0]) <= 120 * n() and same_everywhere(sent[-1])
    assert np.abs(np.mean(sent, axis=0) - exact).mean() < first_error / 3  # nothing lost

    w = tf.Variable(tf.ones([40, 30]))

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * matrix)
        return hvd.DistributedGradientTape(tape, compression=psgd).gradient(loss, [w])[0]
    np.testing.assert_allclose(gradient().numpy(), np.outer(u, v) * total / n(), rtol=1e-3,
                               atol=1e-3)
    with pytest.raises(Exception, match="takes Compression.none"):
        hvd.allreduce(matrix, op=hvd.Max, compression=topk)
    with pytest.raises(Exception, match="call it"):
        hvd.allreduce(matrix, compression=hvd.Compression.topk)


def test_grouped_allreduce_fuses_shapes_and_dtypes():
    tensors = [tf.fill([2, 3], me()), tf.fill([5], 2 * me()), tf.fill([1], int(me())),
               tf.fill([2], tf.cast(me(), tf.float16))]

    @tf.function
    def in_graph(ts):
        return hvd.grouped_allreduce(ts, op=hvd.Sum)

    total = n() * (n() + 1) / 2
    for out in (hvd.grouped_allreduce(tensors, op=hvd.Sum), in_graph(tensors)):
        assert [tuple(t.shape) for t in out] == [(2, 3), (5,), (1,), (2,)]
        assert [t.dtype for t in out] == [t.dtype for t in tensors]
        for t, factor in zip(out, (1, 2, 1, 1)):
            assert np.all(t.numpy() == factor * total)


def test_allreduce_of_indexed_slices_gathers_them():
    slices = tf.IndexedSlices(tf.fill([1, 2], me()), tf.constant([hvd.rank()]),
                              tf.constant([n(), 2]))
    out = hvd.allreduce(slices)
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(out).numpy(),
                               [[(r + 1) / n()] * 2 for r in range(n())], rtol=1e-6)
    # what Horovod does not reduce either: its NotImplementedError, our one-line message
    for bad in (dict(op=hvd.Max), dict(prescale_factor=2.0)):
        with pytest.raises(NotImplementedError, match="mpitrain.horovod does not provide"):
            hvd.allreduce(slices, **bad)


def test_allreduce_and_allgather_are_differentiable():
    x = tf.Variable([1.0, 2.0]) * me()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        reduced = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
        gathered = tf.reduce_sum(hvd.allgather(tf.reshape(x, [1, 2])) ** 2)
    # the gradient of a Sum allreduce is the Sum allreduce of the gradients: n each
    np.testing.assert_allclose(tape.gradient(reduced, x).numpy(), [n(), n()])
    # allgather's: this rank's rows of the averaged gradient
    np.testing.assert_allclose(tape.gradient(gathered, x).numpy(), 2 * x.numpy(), rtol=1e-6)
    # grouped_allreduce's: the same grouped allreduce of the gradients
    group = [tf.Variable([1.0, 2.0]), tf.Variable([[3.0]], dtype=tf.float64)]
    with tf.GradientTape(persistent=True) as tape:
        summed = hvd.grouped_allreduce(group, op=hvd.Sum)
    assert [tape.gradient(s, v).numpy().tolist() for s, v in zip(summed, group)] \
        == [[n(), n()], [[n()]]]
    # broadcast's (Horovod's): the averaged gradient on the root, zero on the others
    with tf.GradientTape() as tape:
        tape.watch(x)
        sent = tf.reduce_sum(hvd.broadcast(x, root_rank=0) * me())
    want = (n() + 1) / 2 if hvd.rank() == 0 else 0.0
    np.testing.assert_allclose(tape.gradient(sent, x).numpy(), [want, want], rtol=1e-6)


def test_grouped_calls_run_in_one_order_in_a_tf1_graph():
    """A grouped call is several collectives (one per tensor, per dtype, per
    IndexedSlices): in a TF1 graph they are chained, so Session.run cannot run them in
    another order on each rank (named alike and shaped alike, they would be mixed)."""
    with tf.Graph().as_default():
        parts = [tf.fill([2, 1], me() * (k + 1)) for k in range(8)]
        gathered = hvd.grouped_allgather(parts)
        scatter_in = [tf.fill([n(), 2], me() * k) for k in range(8)]
        scattered = hvd.grouped_reducescatter(scatter_in, op=hvd.Sum)
        slices = [tf.IndexedSlices(tf.constant([[me() * k]]), tf.constant([0]),
                                   tf.constant([1, 1])) for k in range(1, 5)]
        dtypes = [tf.float32, tf.float64, tf.int32, tf.int64]
        mixed = hvd.grouped_allreduce([tf.cast([me()], d) for d in dtypes] + slices,
                                      op=hvd.Sum)
        # and their gradients: one gradient function, its collectives chained as well
        grads = [tf.gradients(tf.add_n([tf.reduce_sum(g * me()) for g in gathered]), parts),
                 tf.gradients(tf.add_n([tf.reduce_sum(g) for g in scattered]), scatter_in)]
        with tf.compat.v1.Session() as session:  # each grouped call in a run of its own
            got = [session.run(fetch) for fetch in (
                gathered, scattered, mixed[:4] + [t.values for t in mixed[4:]], *grads)]
    ranks = np.arange(1, n() + 1)
    total = n() * (n() + 1) / 2
    assert [part.ravel().tolist() for part in got[0]] == [
        np.repeat(ranks * (k + 1.0), 2).tolist() for k in range(8)]
    assert [part.tolist() for part in got[1]] == [[[total * k] * 2] for k in range(8)]
    assert [v.tolist() for v in got[2][:4]] == [[total]] * 4
    assert [v.ravel().tolist() for v in got[2][4:]] == [(ranks * k).tolist()
                                                        for k in range(1, 5)]
    # allgather's gradient: the average of every rank's factor; reducescatter's (Sum): n
    np.testing.assert_allclose(got[3], np.full((8, 2, 1), total / n()), rtol=1e-6)
    np.testing.assert_allclose(got[4], np.full((8, n(), 2), n()))


def test_gradients_in_a_tf1_graph():
    """tf.gradients through the collectives of a TF1 graph: Horovod's gradients, not None."""
    with tf.Graph().as_default():
        x = tf.constant([1.0, 2.0]) * me()
        reduced = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
        gathered = tf.reduce_sum(hvd.allgather(tf.reshape(x, [1, 2])) ** 2)
        sent = tf.reduce_sum(hvd.alltoall(tf.tile(x, [n()])) * me())
        grouped = tf.reduce_sum(hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1])
        grads = [tf.gradients(y, x)[0] for y in (reduced, gathered, sent, grouped)]
        assert all(g is not None for g in grads)
        with tf.compat.v1.Session() as session:
            values = [session.run(g) for g in grads]
    np.testing.assert_allclose(values[0], [n(), n()])
    np.testing.assert_allclose(values[1], 2 * me() * np.array([1.0, 2.0]), rtol=1e-6)
    # alltoall's: each row's gradient comes back from the rank it went to (rank k: k + 1)
    np.testing.assert_allclose(values[2], [sum(range(1, n() + 1))] * 2, rtol=1e-6)
    np.testing.assert_allclose(values[3], [2 * n(), 2 * n()])


def test_alltoall_sends_each_rank_its_rows():
    """Rank r sends rank k (r + k + 1) rows of 100 r + k; equal splits without splits=;
    eagerly and in tf.function; differentiable; Horovod's errors."""
    k_rows = [hvd.rank() + k + 1 for k in range(n())]
    mine = tf.constant(np.concatenate([np.full((c, 2), 100.0 * hvd.rank() + k)
                                       for k, c in enumerate(k_rows)]), tf.float32)
    expected = np.concatenate([np.full((r + hvd.rank() + 1, 2), 100.0 * r + hvd.rank())
                               for r in range(n())])
    for call in (hvd.alltoall, tf.function(hvd.alltoall)):
        out, received = call(mine, tf.constant(k_rows))
        np.testing.assert_array_equal(out.numpy(), expected)
        assert received.numpy().tolist() == [r + hvd.rank() + 1 for r in range(n())]
    equal = hvd.alltoall(tf.reshape(tf.range(2 * n(), dtype=tf.int64) + 10 * hvd.rank(),
                                     [2 * n(), 1]))
    assert equal.numpy().ravel().tolist() == [10 * r + 2 * hvd.rank() + i for r in range(n())
                                              for i in range(2)]
    with tf.GradientTape() as tape:
        tape.watch(mine)
        out, _ = hvd.alltoall(mine, k_rows)
        y = tf.reduce_sum(out * me())
    np.testing.assert_allclose(tape.gradient(y, mine).numpy(),  # the receiver's factor
                               np.concatenate([np.full((c, 2), k + 1.0)
                                               for k, c in enumerate(k_rows)]))
    if n() > 1:
        with pytest.raises(tf.errors.InvalidArgumentError, match="first dimension is"):
            hvd.alltoall(tf.ones([n() + 1]))
        with pytest.raises(tf.errors.FailedPreconditionError, match="alltoall"):
            hvd.alltoall(tf.ones([n(), 1 + hvd.rank()]))


def test_allgather_takes_first_dimensions_that_differ():
    mine = tf.fill([hvd.rank() + 1, 2], me())

    @tf.function
    def in_graph(t):
        return hvd.allgather(t)

    expected = np.concatenate([np.full((r + 1, 2), r + 1.0) for r in range(n())])
    for out in (hvd.allgather(mine), in_graph(mine)):
        np.testing.assert_array_equal(out.numpy(), expected)
    ints = hvd.grouped_allgather([tf.constant([hvd.rank()]), tf.constant([[True]])])
    assert ints[0].numpy().tolist() == list(range(n())) and ints[1].shape == (n(), 1)
    assert hvd.allgather_object({"rank": hvd.rank()}) == [{"rank": r} for r in range(n())]


def test_broadcasts():
    root = n() - 1
    got = hvd.broadcast(tf.fill([3], me()), root_rank=root)
    assert np.all(got.numpy() == n())

    @tf.function
    def in_graph(t):
        return hvd.broadcast(t, root_rank=0)

    assert np.all(in_graph(tf.fill([2, 2], me())).numpy() == 1.0)
    assert hvd.broadcast_object(("from", hvd.rank()), root_rank=root) == ("from", root)
    assert hvd.broadcast_object_fn(root_rank=0)(hvd.rank()) == 0
    with pytest.raises(hvd.world.UsageError, match="root_rank"):
        hvd.broadcast(tf.ones([1]), root_rank=n())


def test_broadcast_in_place_returns_the_values_eagerly_and_in_a_graph():
    first, second = tf.Variable([me(), me()]), tf.Variable(np.full((2, 2), me()))
    got = hvd.broadcast_([first, second], root_rank=n() - 1)
    assert [g.dtype for g in got] == [tf.float32, tf.float64]
    np.testing.assert_array_equal(got[0].numpy(), [n(), n()])
    np.testing.assert_array_equal(second.numpy(), np.full((2, 2), float(n())))
    first.assign([me(), me()])
    in_graph = tf.function(lambda: hvd.broadcast_([first], root_rank=0))()
    np.testing.assert_array_equal(in_graph[0].numpy(), [1.0, 1.0])
    np.testing.assert_array_equal(first.numpy(), [1.0, 1.0])


def test_local_layers_and_variables_stay_this_ranks_own():
    """PartialDistributedOptimizer's local layers are updated with this rank's gradient
    alone; BroadcastGlobalVariablesCallback(local_variables=...) leaves them out."""
    shared, local = keras.layers.Dense(2), keras.layers.Dense(2)
    model = keras.Sequential([keras.Input((3,)), shared, local])
    callback = hvdk.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=local.trainable_weights)
    callback.set_model(model)
    local.kernel.assign(tf.fill([2, 2], me()))
    callback.on_train_begin()
    assert same_everywhere(shared.kernel.numpy())
    np.testing.assert_array_equal(local.kernel.numpy(), np.full((2, 2), me()))
    optimizer = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=local)
    local.kernel.assign(tf.ones([2, 2]))  # the same everywhere before the step
    x = tf.fill([4, 3], me())  # each rank its own data: its own gradients
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    assert same_everywhere(shared.kernel.numpy())
    if n() > 1:
        assert not same_everywhere(local.kernel.numpy())


def test_broadcast_global_variables_of_a_tf1_graph():
    """Every global variable of a TF1 graph takes the root's value, whatever its dtype (one
    broadcast per dtype, in one order on every rank); eagerly a RuntimeError, as Horovod's."""
    root = n() - 1
    with tf.Graph().as_default():
        floats = tf.compat.v1.Variable([me(), 2 * me()])
        ints = tf.compat.v1.Variable([hvd.rank()], dtype=tf.int64)
        doubles = tf.compat.v1.Variable(me(), dtype=tf.float64)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(hvd.broadcast_global_variables(root))
            got = session.run([floats, ints, doubles])
    assert got[0].tolist() == [n(), 2.0 * n()] and got[1].tolist() == [root] and got[2] == n()
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_broadcast_variables_of_tensorflow_and_keras():
    plain = tf.Variable(tf.fill([4], me()))
    counter = tf.Variable(int(me()))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    hvd.broadcast_variables([plain, counter] + model.variables, root_rank=0)
    assert np.all(plain.numpy() == 1.0) and int(counter.numpy()) == 1
    assert same_everywhere(np.concatenate([v.numpy().ravel() for v in model.variables]))
    plain.assign(tf.fill([4], me()))

    @tf.function
    def in_graph():
        hvd.broadcast_variables([plain], root_rank=n() - 1)

    in_graph()
    assert np.all(plain.numpy() == n())


def test_reducescatter_splits_the_first_dimension_as_horovod():
    rows = 2 * n() + 1  # the first rows % n ranks get one row more
    got = hvd.reducescatter(tf.fill([rows, 2], me()), op=hvd.Sum).numpy()
    mine = rows // n() + (1 if hvd.rank() < rows % n() else 0)
    assert got.shape == (mine, 2) and np.all(got == n() * (n() + 1) / 2)
    # Horovod's gradient: every rank's output gradient gathered (times size for a Sum)
    x = tf.fill([rows, 2], me())

    def gradient(op):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(hvd.reducescatter(x, op=op) * me())
        return tape.gradient(loss, x)

    owners = np.repeat([r + 1.0 for r in range(n())],  # each row's rank's me()
                       [rows // n() + (r < rows % n()) for r in range(n())])
    for op, factor in ((hvd.Average, 1), (hvd.Sum, n())):
        for run in (gradient, tf.function(gradient)):  # eagerly and in a graph
            np.testing.assert_allclose(run(op).numpy(), factor * np.tile(owners[:, None], 2),
                                       rtol=1e-6)


def test_barrier_and_join():
    hvd.barrier()

    @tf.function
    def graph_barrier():
        return hvd.barrier()

    graph_barrier()
    # rank 0 joins first; the others still average, rank 0 adding zeros (Horovod's rule:
    # an Average still divides by every rank), then join; the last rank joined last
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        got = hvd.allreduce(tf.constant([me()]))
        assert got.numpy()[0] == pytest.approx((n() * (n() + 1) / 2 - 1) / n())
        last = hvd.join()
    assert int(last) == n() - 1


def test_distributed_gradient_tape():
    w = tf.Variable([1.0, 2.0, 3.0])
    emb = tf.Variable(tf.ones([n() + 1, 2]))
    local = tf.Variable([5.0])

    def loss():
        return (tf.reduce_sum(w * me()) + tf.reduce_sum(tf.gather(emb, [hvd.rank()]) * me())
                + tf.reduce_sum(local * me()))

    def gradients(**options):
        with tf.GradientTape() as tape:
            value = loss()
        tape = hvd.DistributedGradientTape(tape, **options)
        tape.register_local_source(local)
        return tape.gradient(value, [w, emb, local])

    mean = (n() + 1) / 2
    g_w, g_emb, g_local = gradients()
    np.testing.assert_allclose(g_w.numpy(), [mean] * 3, rtol=1e-6)
    assert isinstance(g_emb, tf.IndexedSlices)  # gathered from every rank, averaged
    dense = tf.convert_to_tensor(g_emb).numpy()
    np.testing.assert_allclose(dense[:n()], [[(r + 1) / n()] * 2 for r in range(n())], rtol=1e-6)
    np.testing.assert_allclose(g_local.numpy(), [me() / n()])  # local: only scaled by 1/n

    @tf.function
    def in_graph():
        return gradients(sparse_as_dense=True, op=hvd.Sum,
                         compression=hvd.Compression.fp16)

    g_w, g_emb, _ = in_graph()
    np.testing.assert_allclose(g_w.numpy(), [n() * mean] * 3, rtol=1e-3)
    assert not isinstance(g_emb, tf.IndexedSlices) and g_emb.shape == (n() + 1, 2)
    assert same_everywhere(g_w.numpy())


def test_distributed_optimizer_in_a_loop_and_with_passes():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    hvd.broadcast_variables(model.variables, root_rank=0)
    x = tf.fill([8, 4], me())
    y = tf.zeros([8], tf.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(opt):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "SGD"
    before = [v.numpy() for v in model.trainable_variables]
    grads = step(opt)
    every = hvd.allgather_object([g.numpy() for g in grads])  # the local gradients
    for v, b, *gs in zip(model.trainable_variables, before, *every):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * np.mean(gs, axis=0), rtol=1e-5,
                                   atol=1e-6)
    assert same_everywhere(np.concatenate([v.numpy().ravel() for v in model.variables]))
    # two passes per update: the first only counts, the second applies their average
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    train = tf.function(lambda: step(opt))
    before = [v.numpy() for v in model.trainable_variables]
    train()
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.trainable_variables, before))
    assert int(opt.iterations) == 1
    train()
    assert int(opt.iterations) == 2
    assert not all(np.array_equal(v.numpy(), b) for v, b in zip(model.trainable_variables,
                                                                 before))
    assert same_everywhere(np.concatenate([v.numpy().ravel() for v in model.variables]))


def test_keras_fit_with_every_callback(tmp_path_factory):
    """model.fit data-parallel: a tf.data dataset sharded per rank, validation data, the
    four callbacks and a rank-0-only checkpoint. After it every rank holds rank 0's
    start plus the same averaged updates (identical weights), the epoch's logs are
    averaged, and the learning rate follows Horovod's warm-up formula."""
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast fixes
    rng = np.random.default_rng(0)
    x = rng.random((96, 6), dtype=np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shard(n(), hvd.rank()).batch(4).repeat()
    valid = tf.data.Dataset.from_tensor_slices((x[:16], y[:16])).batch(8)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    lr = 0.05 * n()
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(dict(logs)))
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("fit") / "model-{epoch}.keras"))
    callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvdk.callbacks.MetricAverageCallback(),
                 hvdk.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2),
                 hvdk.callbacks.LearningRateScheduleCallback(initial_lr=lr, multiplier=0.5,
                                                             start_epoch=2),
                 record]
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(path))
    history = model.fit(data, steps_per_epoch=3, epochs=3, validation_data=valid,
                        callbacks=callbacks, shuffle=False, verbose=0)
    assert same_everywhere(np.concatenate([v.numpy().ravel() for v in model.variables]))
    assert same_everywhere(np.array([[logs[k] for k in sorted(logs)] for logs in seen]))
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "lr"} <= set(history.history)
    # warm-up: epoch 1 (index 1) ends at lr/n * (1 + 1/3 ... Horovod's per-batch formula
    warm = lr / n() * ((1 + 2 / 3 + 1 / 3) * (n() - 1) / 2 + 1)
    assert history.history["lr"][1] == pytest.approx(warm, rel=1e-5)
    assert history.history["lr"][2] == pytest.approx(lr * 0.5 ** 0, rel=1e-5)
    saved = hvd.allgather_object(sorted(p.name for p in __import__("pathlib").Path(
        path).parent.glob("*.keras")))
    assert saved[0] == ["model-1.keras", "model-2.keras", "model-3.keras"]
    loaded = hvdk.load_model(path.format(epoch=3))  # every rank reads rank 0's file
    assert hasattr(loaded.optimizer, "_hvd_reducer")
    assert int(loaded.optimizer.iterations) == 9


def test_disagreeing_ranks_all_stop_with_the_same_line():
    if n() == 1:
        pytest.skip("one rank agrees with itself")
    cases = [lambda: hvd.allreduce(tf.ones([2 + hvd.rank()])),
             lambda: hvd.allreduce(tf.ones([2], tf.float64 if hvd.rank() else tf.float32)),
             lambda: hvd.allgather(tf.ones([1, 1 + hvd.rank()])),
             lambda: hvd.broadcast(tf.ones([2]), root_rank=hvd.rank()),
             lambda: hvd.barrier() if hvd.rank() else hvd.allreduce(tf.ones([1]))]
    for case in cases:
        # Horovod's error type (eagerly; inside a graph TensorFlow makes it UnknownError)
        with pytest.raises(tf.errors.FailedPreconditionError) as raised:
            case()
        assert isinstance(raised.value, Mismatch)
        text = str(raised.value)
        assert text.startswith("the ranks disagree at collective #") and "rank 0 on" in text
        assert len(set(hvd.allgather_object(text))) == 1  # the same line on every rank
    hvd.barrier()  # and the ranks go on together


def test_a_tf1_graphs_collectives_met_in_another_order_are_caught_not_mixed():
    """Two same-shaped allreduces of a TF1 graph, run in another order on each rank (as
    Session.run does with independent collectives): paired by order they would be
    summed together, silently; named after their tensors, every rank stops at the
    first with the same line, naming both."""
    if n() == 1:
        pytest.skip("one rank agrees with itself")
    with tf.Graph().as_default():
        first = hvd.allreduce(tf.constant([1.0, 2.0], name="first"), op=hvd.Sum)
        second = hvd.allreduce(tf.constant([3.0, 4.0], name="second"), op=hvd.Sum)
        named = hvd.allreduce(tf.constant([5.0, 6.0]), op=hvd.Sum, name="same_everywhere")
        with tf.compat.v1.Session() as session:
            with pytest.raises(tf.errors.OpError) as raised:
                session.run(first if hvd.rank() % 2 == 0 else second)
            assert session.run(named).tolist() == [5.0 * n(), 6.0 * n()]  # still in step
    text = str(raised.value)
    assert "the ranks disagree at collective #" in text and "'first:0'" in text
    assert "'second:0'" in text and "a TF1 graph's Session.run" in text
    line = text[text.index("the ranks disagree"):].splitlines()[0]
    assert len(set(hvd.allgather_object(line))) == 1


def test_a_rank_that_leaves_is_named_at_once_by_every_rank():
    """The last rank leaves (its script ended) while the others allreduce: all raise the
    same Mismatch at that call, naming it, to be printed by rank 0 (rank 0 stays)."""
    if n() == 1:
        pytest.skip("no other rank to leave")
    from mpitrain.horovod.world import engine

    with pytest.raises(Mismatch) as raised:
        if hvd.rank() == n() - 1:
            engine().leave()
        else:
            hvd.allreduce(tf.ones([3]))
    text = str(raised.value)
    assert f"rank {n() - 1} on " in text and "left the job (its script ended" in text
    assert raised.value.reporter == 0
    assert len(set(hvd.allgather_object(text))) == 1
    hvd.barrier()  # and the ranks go on together (a rank that really left would not)


def test_unprovided_features_name_the_alternative():
    for call in (lambda: hvd.allreduce(tf.ones([1]), process_set=object()),
                 lambda: hvd.run(print), lambda: hvd.ProcessSet([0]),
                 lambda: hvd.start_timeline("t.json")):
        with pytest.raises(Unsupported, match="mpitrain.horovod does not provide"):
            call()
    with pytest.raises(Unsupported, match="mpitrain launch"):
        hvd.run(lambda: None)


def test_elastic_state_commits_restores_syncs_and_resumes(tmp_path_factory, monkeypatch):
    """Horovod's State semantics (its test_elastic_state's), then what mpitrain adds under
    mpitrain launch: a commit writes rank 0's state, and the next attempt's
    hvd.elastic.run starts from it, every rank, the reset callbacks run once."""
    import signal

    from mpitrain.horovod import elastic
    from mpitrain.results.run_dir import ELASTIC_ENV

    v = tf.Variable(np.full((2, 2), me()))
    state = hvd.elastic.TensorFlowState([v], batch=20 + hvd.rank(), epoch=10)
    state.sync()  # rank 0's everywhere
    assert np.all(v.numpy() == 1.0) and (state.batch, state.epoch) == (20, 10)
    v.assign(np.full((2, 2), 5.0))
    state.batch = 21
    state.restore()  # back to the last commit
    assert np.all(v.numpy() == 1.0) and state.batch == 20
    v.assign(np.full((2, 2), 5.0))
    state.batch = 21
    state.commit()  # (not under mpitrain launch: in memory only)
    state.restore()
    assert np.all(v.numpy() == 5.0) and state.batch == 21

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1 * n(), momentum=0.9)
    optimizer.apply_gradients([(tf.ones_like(w), w) for w in model.trainable_variables])
    keras_state = hvdk.elastic.KerasState(model, optimizer, epoch=3)
    keras_state.sync()  # (each rank's model began with weights of its own)
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("elastic") / "state.pkl"))
    monkeypatch.setenv(ELASTIC_ENV, path)
    monkeypatch.setattr(elastic, "PERSIST_EVERY", 0.0)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        keras_state.commit()  # written by rank 0; no rank asked to stop: goes on
        # the next attempt: a new model and an optimizer not built yet
        again = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        fresh = keras.optimizers.SGD(0.1, momentum=0.9)
        resumed = hvdk.elastic.KerasState(again, fresh, epoch=0)
        resets = []
        resumed.register_reset_callbacks([lambda: resets.append(hvd.size())])
        epoch = hvdk.elastic.run(lambda s: s.epoch)(resumed)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert epoch == 3 and resets == [n()]
    for mine, saved in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(mine, saved)
    momenta = [var.numpy() for var in elastic.optimizer_variables(fresh)]
    assert len(momenta) == len(elastic.optimizer_variables(optimizer)) and \
        same_everywhere(np.concatenate([m.ravel() for m in momenta]))


def test_shutdown_then_init_again():
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(NotInitialized, match="call hvd.init"):
        hvd.rank()
    hvd.init(timeout=60)
    assert hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy() == n()
