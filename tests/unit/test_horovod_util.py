"""``hvd.util``: Horovod's helpers that scripts import by that name (in-process: none of
them talks to other ranks)."""

import mpitrain.horovod as hvd
from mpitrain.horovod.util import _executing_eagerly, refs_to_vars, vars_to_refs
from mpitrain.models.keras_import import import_tensorflow

tf = import_tensorflow()


def test_executing_eagerly_is_false_while_a_graph_is_built():
    seen = []

    @tf.function
    def traced():
        seen.append(hvd.util._executing_eagerly())
        return tf.constant(0)

    traced()
    assert (_executing_eagerly(), hvd._executing_eagerly(), seen) == (True, True, [False])
    with tf.Graph().as_default():
        assert not hvd._executing_eagerly()


def test_refs_round_trip_to_the_same_variables_in_their_order():
    a, b = tf.Variable(1.0), tf.Variable([2.0, 3.0])
    refs = vars_to_refs([b, a])
    assert len(set(refs)) == 2  # hashable, one each
    assert [v is w for v, w in zip(refs_to_vars(refs), [b, a])] == [True, True]
