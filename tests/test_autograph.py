"""Autograph leaves tfhybrid's code alone and still converts the user's.

tfhybrid's graph code branches on Python values only, so converting it would change no
op and only cost trace time; a user's own function, and a user's subclass overriding a
method, must still be converted (a tensor ``if`` in them becomes a ``tf.cond``).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.impl import conversion

import tfhybrid
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding


class _UserLayer(DistributedEmbedding):
    """A user's subclass: its own ``call`` lives in the user's module."""

    def call(self, inputs):
        outputs = super().call(inputs)
        # a tensor condition: only autograph makes this a graph branch
        if tf.reduce_sum(outputs[0]) > 0.0:
            return [2.0 * o for o in outputs]
        return outputs


class AutographTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_tfhybrid_functions_are_exempt_and_user_code_is_not(self):
        # the rule is installed when tfhybrid's objects are made (never by the import:
        # test_tf_internals), as a user's first layer is
        Embedding(10, 3, combiner="sum")
        for fn in (DistributedEmbedding.call, tfhybrid.DistributedOptimizer,
                   collectives.alltoall, tfhybrid.DistributedGradientTape):
            self.assertTrue(conversion.is_allowlisted(fn), msg=fn)
        self.assertFalse(conversion.is_allowlisted(_UserLayer.call))

    def test_a_user_subclass_with_a_tensor_condition_traces_and_branches(self):
        mesh = tfhybrid.init(model_parallel=1)
        layer = _UserLayer([Embedding(10, 3, combiner="sum", name="t")], mesh=mesh)
        ids = tf.constant([[1, 2], [3, 3]], tf.int64)
        layer([ids])
        table = np.arange(30, dtype=np.float32).reshape(10, 3) / 10.0
        layer.set_weights([table])
        want = table[[1, 3]] + table[[2, 3]]

        @tf.function
        def forward(x, sign):
            # the user's own tensor condition, converted as before
            if sign < 0:
                return [-o for o in layer([x])]
            return layer([x])

        got = forward(ids, tf.constant(1.0))[0]
        self.assertAllEqual(got, 2.0 * want)        # the subclass' branch was taken
        self.assertAllEqual(forward(ids, tf.constant(-1.0))[0], -2.0 * want)
        layer.set_weights([-table])
        self.assertAllEqual(forward(ids, tf.constant(1.0))[0], -want)


if __name__ == "__main__":
    tf.test.main()
