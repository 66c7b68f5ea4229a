"""TrainPipeline's errors: input that ends early on one rank, a bad id read ahead, a model
that skips its embedding, bad arguments; and a pipeline made before the model is built,
detached again. Every error is raised on every rank, never a hang.
"""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding
from tfhybrid.pipeline import TrainPipeline
from tests import _hybrid_case as hc

HOROVOD_NP = (4,)
KERAS = (2, 3)


class _Subclassed(tf.keras.Model):
    """A subclassed model: its DistributedEmbedding is built by the first batch."""

    def __init__(self, case, mesh):
        # Keras 3 name scopes refuse the "_subclassed" its class name would give
        super().__init__(name="subclassed")
        self.embedding = DistributedEmbedding(case.embedding_layers(), mesh=mesh,
                                              **hc.PLANNERS.get(case.tables, {}))
        self.flat = tf.keras.layers.Flatten()
        self.head = tf.keras.layers.Dense(1)

    def call(self, ids):
        return self.head(tf.concat([self.flat(x) for x in self.embedding(list(ids))], 1))


class PipelineErrorsTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _pipelined(self, case, mesh):
        model, layer = case.compiled_model(mesh, lambda: tf.keras.optimizers.SGD(0.1))
        TrainPipeline(model)
        return model, layer

    def test_input_that_ends_early_on_one_rank_fails_everywhere(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=4, world=world, seed=7)
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = self._pipelined(case, mesh)
        ids, labels = case.local_data(mesh.rank)
        batches = case.steps - (1 if mesh.rank == world - 1 else 0)
        data = tf.data.Dataset.from_tensor_slices((tuple(ids), labels)).batch(
            case.local_batch).take(batches)
        # agreed in the id check's allgather, so every rank raises the same error
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    rf"the input of ranks \[{world - 1}\] ended while"):
            model.fit(data, verbose=0)

    def test_a_bad_id_in_the_batch_read_ahead_fails_on_every_rank(self):
        """...after the step beside it has finished: its update is whole."""
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=3, world=world, seed=8)
        mesh = tfhybrid.init(model_parallel=min(2, world))
        model, layer = self._pipelined(case, mesh)
        ids, labels = case.local_data(mesh.rank)
        wide = np.array(ids[0])
        if mesh.rank == world - 1:
            wide[-1, 0] = 64   # the last batch: found while the second-last one trains
        data = tf.data.Dataset.from_tensor_slices(((wide,) + tuple(ids[1:]), labels)).batch(
            case.local_batch)
        # the message quotes the table's name as TF escapes it: \'wide\'
        message = rf"table .{{1,2}}wide.{{1,2}} got id 64 on rank {world - 1}"
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, message):
            model.fit(data, verbose=0)
        # the two good batches trained exactly as the plain loop trains them
        plain, plain_layer = case.compiled_model(mesh, lambda: tf.keras.optimizers.SGD(0.1))
        plain.fit(data.take(case.steps - 1), verbose=0)
        for got, want in zip(hc.model_weights(model, layer),
                             hc.model_weights(plain, plain_layer)):
            self.assertAllEqual(got, want)

    def test_a_model_that_skips_its_embedding_is_refused(self):
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=2, world=hc.world_size())
        mesh = tfhybrid.init(model_parallel=1)
        model, layer = case.distributed_model(mesh)
        optimizer = tf.keras.optimizers.SGD(0.1)

        def train_step(batch):   # never calls the model
            return tf.reduce_sum(batch[1])

        pipeline = TrainPipeline(model, train_step)
        ids, labels = case.local_data(mesh.rank)
        data = tf.data.Dataset.from_tensor_slices((tuple(ids), labels)).batch(2)
        with self.assertRaisesRegex(ValueError, r"did not call DistributedEmbedding layers "
                                                rf"\['{layer.name}'\]"):
            pipeline.progress(iter(data))
        del optimizer

    def test_a_pipeline_made_before_the_model_is_built_equals_the_plain_loop(self):
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=4, world=hc.world_size(),
                       seed=10)
        mesh = tfhybrid.init(model_parallel=min(2, hc.world_size()))
        ids, labels = case.local_data(mesh.rank)
        losses, weights = {}, {}
        for piped in (False, True):
            tf.keras.utils.set_random_seed(3)   # the same head in both runs
            model = _Subclassed(case, mesh)
            model.compile(optimizer=tfhybrid.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.1)), loss=hc.loss_fn)
            if piped:
                # before any batch: a subclassed model builds its layers on the first one
                self.assertFalse(model.embedding.built)
                TrainPipeline(model)
            losses[piped] = model.fit(ids, labels, batch_size=case.local_batch,
                                      shuffle=False, verbose=0).history["loss"]
            weights[piped] = model.embedding.get_weights(all_ranks=True)
        self.assertEqual(losses[True], losses[False])
        self.assertEqual(len(weights[True]), len(weights[False]))
        for piped_table, plain_table in zip(weights[True], weights[False]):
            self.assertAllEqual(piped_table, plain_table)

    def test_bad_arguments_name_the_value(self):
        with self.assertRaisesRegex(ValueError, "needs a tf.keras.Model; got 3"):
            TrainPipeline(3)
        model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
        with self.assertRaisesRegex(ValueError, "train_step='step' must be callable"):
            TrainPipeline(model, "step")
        with self.assertRaisesRegex(ValueError, r"placement='late' is not one of"):
            TrainPipeline(model).placement = "late"

    def test_detach_gives_fit_back_to_keras(self):
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=4, world=hc.world_size(),
                       seed=9)
        mesh = tfhybrid.init(model_parallel=1)
        model, _ = case.compiled_model(mesh, lambda: tf.keras.optimizers.SGD(0.1))
        keras_make = model.make_train_function
        pipeline = TrainPipeline(model)
        self.assertNotEqual(model.make_train_function, keras_make)
        pipeline.detach()
        self.assertEqual(model.make_train_function, keras_make)
        ids, labels = case.local_data(mesh.rank)
        history = model.fit(ids, labels, batch_size=2, shuffle=False, verbose=0)
        self.assertLen(history.history["loss"], 1)


if __name__ == "__main__":
    tf.test.main()
