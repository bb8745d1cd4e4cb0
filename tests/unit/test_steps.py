"""A replica's pieces on their own (TensorFlow, no MPI): the flat layout, the bucket
hand-offs, the XLA-or-graph fallback. Replica as a whole: test_replica.py."""

import numpy as np

from mpitrain.models.replica import bucket_bounds, init_tensorflow
from mpitrain.models.steps import FlatLayout, XlaOrGraph, bucket_hand_offs


def test_the_flat_layout_is_the_variables_in_order():
    init_tensorflow(1, 0)
    import tensorflow as tf

    variables = [tf.Variable(np.zeros((2, 3), np.float32)), tf.Variable(np.zeros(4, np.float32))]
    layout = FlatLayout(variables)
    assert (layout.shapes, layout.sizes, layout.n_params) == ([(2, 3), (4,)], [6, 4], 10)
    flat = np.arange(10, dtype=np.float32)
    layout.assign(tf.constant(flat))
    assert np.array_equal(variables[0].numpy(), flat[:6].reshape(2, 3))
    assert np.array_equal(variables[1].numpy(), flat[6:])


def test_each_bucket_copies_its_gradients_into_place_and_says_so():
    sizes = [3, 2, 4]
    bounds = bucket_bounds(sizes, 4 * 4)  # the last variable alone, then the first two
    assert bounds == [(5, 9), (0, 5)]
    view = np.zeros(9 + 2, np.float32)  # a status tail the hand-offs leave alone
    ready = []
    hand_offs = bucket_hand_offs(view, sizes, bounds, ready.append)
    assert [indices for indices, _ in hand_offs] == [[2], [0, 1]]
    grads = [np.full(s, i + 1, np.float32) for i, s in enumerate(sizes)]
    for indices, hand_off in hand_offs:  # in back-propagation's order, as TensorFlow runs them
        assert hand_off(*(grads[i] for i in indices)) == 0
    assert ready == [0, 1]
    assert view.tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0]


def test_a_step_xla_cannot_compile_runs_in_graph_mode_for_good():
    import tensorflow as tf

    calls = []

    def jit(x):
        calls.append("xla")
        raise tf.errors.UnimplementedError(None, None, "no XLA kernel")

    def graph(x):
        calls.append("graph")
        return x + 1

    modes = {"grad": "xla"}
    step = XlaOrGraph(jit, graph, "grad", modes)
    assert (step(1), step(2)) == (2, 3)
    assert calls == ["xla", "graph", "graph"]  # XLA tried once only
    assert modes == {"grad": "graph (XLA could not compile it)"}
