"""DistributedEmbedding on every D x M mesh equals a single-process Keras model.

Each rank builds the single-process reference on the global batch (all ranks draw the
same seeded data), trains the distributed model on its own slice, and compares.
"""

import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid import plan as planning
from tfhybrid.layers import DistributedEmbedding, Embedding
from tests import _hybrid_case as hc

KERAS_3 = tfhybrid.keras_major() == 3

# four ranks hold groups of two both ways (2x2), and the 1D meshes of four;
# two ranks would only repeat them at a smaller size
HOROVOD_NP = (1, 4)
KERAS = (2, 3)

LOCAL_BATCH = 4
STEPS = 5
# thresholds (elements) chosen so every kind of placement appears
THRESHOLDS = dict(data_parallel_threshold=400, column_slice_threshold=1000,
                  row_slice_threshold=4000)
# name, (min rows, max rows), dim, combiner -- ranges keep each table in its kind
TABLES = [
    ("dp_none", (30, 45), 8, None),        # data_parallel
    ("rows_sum", (300, 400), 16, "sum"),   # row_wise
    ("cols_mean", (100, 125), 12, "mean"),  # column_wise
    ("tw_sum", (80, 95), 6, "sum"),        # table_wise
    ("tw_none", (150, 190), 5, None),      # table_wise, no combiner
    ("rows_mean", (450, 600), 10, "mean"),  # row_wise
    ("dp_mean", (20, 40), 7, "mean"),      # data_parallel
]
# feature -> (table index, kind of input): one-hot, fixed multi-hot [b, h], ragged
FEATURES = [
    (0, "onehot"),
    (1, "multihot3"), (1, "ragged0"),      # shared row-wise table, sum
    (2, "ragged1"), (2, "multihot2"),      # shared column-wise table, mean
    (3, "onehot"),
    (4, "multihot2"),
    (5, "ragged1"),
    (6, "ragged1"),
]


def _world():
    return hvd.size() if hvd.is_initialized() else 1


def make_tables(seed):
    rng = np.random.default_rng(seed)
    return [(name, int(rng.integers(lo, hi + 1)), dim, combiner)
            for name, (lo, hi), dim, combiner in TABLES]


def make_batch(rng, tables, batch):
    features = []
    for t, kind in FEATURES:
        rows = tables[t][1]
        if kind == "onehot":
            features.append(rng.integers(0, rows, size=[batch]))
        elif kind.startswith("multihot"):
            features.append(rng.integers(0, rows, size=[batch, int(kind[-1])]))
        else:  # raggedK: bags of K..4 ids
            lengths = rng.integers(int(kind[-1]), 5, size=[batch])
            values = rng.integers(0, rows, size=[int(lengths.sum())])
            features.append((values, lengths))
    return features


def to_tensors(features, start=0, stop=None):
    out = []
    for f in features:
        if isinstance(f, tuple):
            # sliced in numpy: a ragged slice in eager runs dozens of small ops per call
            values, lengths = f
            first = int(lengths[:start].sum())
            kept = lengths[start:stop]
            out.append(tf.RaggedTensor.from_row_lengths(
                values[first:first + int(kept.sum())], kept))
        else:
            out.append(tf.constant(f[start:stop]))
    return out


class _Reference(tf.keras.Model):
    """Plain Keras Embedding layers + combine + Dense, on the global batch."""

    def __init__(self, tables):
        # named: Keras 3 refuses a name scope "__reference" (from the class name) in a graph
        super().__init__(name="reference")
        self.tables = [tf.keras.layers.Embedding(rows, dim, name=name)
                       for name, rows, dim, _ in tables]
        self.combiners = [c for *_, c in tables]
        self.head = tf.keras.layers.Dense(1, kernel_initializer="glorot_uniform")

    def embed(self, inputs):
        outs = []
        for (t, _), ids in zip(FEATURES, inputs):
            emb = self.tables[t](ids)
            if ids.shape.rank == 1:
                pass  # one id per sample: nothing to combine
            elif self.combiners[t] == "sum":
                emb = tf.reduce_sum(emb, axis=1)
            elif self.combiners[t] == "mean":
                emb = tf.reduce_mean(emb, axis=1)
            if isinstance(emb, tf.RaggedTensor):
                emb = emb.to_tensor()
            outs.append(emb)
        return outs

    def call(self, inputs):
        outs = self.embed(inputs)
        flat = tf.concat([tf.reshape(o, [tf.shape(o)[0], -1]) for o in outs], axis=1)
        return self.head(flat)


class _Distributed(tf.keras.Model):
    def __init__(self, tables, mesh):
        super().__init__(name="distributed")
        self.embedding = DistributedEmbedding(
            [Embedding(rows, dim, combiner=c, name=name) if c else
             tf.keras.layers.Embedding(rows, dim, name=name)
             for name, rows, dim, c in tables],
            mesh=mesh, input_table_map=[t for t, _ in FEATURES], **THRESHOLDS)
        self.head = tf.keras.layers.Dense(1)

    def call(self, inputs):
        outs = self.embedding(inputs)
        flat = tf.concat([tf.reshape(o, [tf.shape(o)[0], -1]) for o in outs], axis=1)
        return self.head(flat)


def _rows_once(grad):
    """``grad`` with each row of a sparse gradient once (its duplicates summed)."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows, position = tf.unique(grad.indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(grad.values, position,
                                                         tf.size(rows)),
                            rows, grad.dense_shape)


def logistic_loss(labels, logits):
    return tf.reduce_mean(tf.keras.losses.binary_crossentropy(labels, logits,
                                                              from_logits=True))


class ParityTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _run(self, model_parallel, layout, optimizer_name, use_function):
        world = _world()
        mesh = tfhybrid.init(model_parallel=model_parallel, layout=layout)
        world = mesh.size
        seed = 1000 * model_parallel + (7 if layout == "data_major" else 0)
        # every rank's reference must start alike, whatever earlier subtests drew
        tf.keras.utils.set_random_seed(seed)
        tables = make_tables(seed)
        rng = np.random.default_rng(seed + 1)
        global_batch = LOCAL_BATCH * world
        batches = [(make_batch(rng, tables, global_batch),
                    rng.integers(0, 2, size=[global_batch, 1]).astype(np.float32))
                   for _ in range(STEPS)]

        reference = _Reference(tables)
        reference(to_tensors(batches[0][0]))
        model = _Distributed(tables, mesh)
        lo, hi = mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH
        model(to_tensors(batches[0][0], lo, hi))
        full_tables = [layer.embeddings.numpy() for layer in reference.tables]
        model.embedding.set_weights(full_tables)
        model.head.set_weights(reference.head.get_weights())

        kinds = {p.kind for p in model.embedding.plan.tables}
        if world > 1 and model_parallel > 1:
            self.assertEqual(kinds, {"data_parallel", "row_wise", "column_wise",
                                     "table_wise"})

        # forward parity on this rank's slice
        local_out = model.embedding(to_tensors(batches[0][0], lo, hi))
        ref_out = reference.embed(to_tensors(batches[0][0]))
        for f, (got, want) in enumerate(zip(local_out, ref_out)):
            self.assertAllClose(got, want[lo:hi], atol=1e-6, rtol=1e-6,
                                msg=f"feature {f} forward")

        if optimizer_name == "sgd":
            make = lambda: tf.keras.optimizers.SGD(learning_rate=0.5)  # noqa: E731
        else:
            # Keras 2's legacy Adagrad (DE's scripts use it); Keras 3 has one Adagrad
            adagrad = (tf.keras.optimizers.Adagrad if KERAS_3
                       else tf.keras.optimizers.legacy.Adagrad)
            make = lambda: adagrad(learning_rate=0.3)  # noqa: E731
        ref_opt = make()
        dist_opt = tfhybrid.DistributedOptimizer(make(), mesh=mesh)

        def ref_step(inputs, labels):
            with tf.GradientTape() as tape:
                loss = logistic_loss(labels, reference(inputs))
            grads = tape.gradient(loss, reference.trainable_variables)
            if KERAS_3:
                # Keras 2's optimizers sum a sparse gradient's duplicate rows before the
                # update; Keras 3's update each duplicate on its own, which for Adagrad
                # is another update (the square of a sum is not the sum of squares)
                grads = [_rows_once(g) for g in grads]
            ref_opt.apply_gradients(zip(grads, reference.trainable_variables))
            return loss

        def dist_step(inputs, labels):
            with tf.GradientTape() as tape:
                loss = logistic_loss(labels, model(inputs))
            grads = tape.gradient(loss, model.trainable_variables)
            dist_opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        if use_function:
            # ragged shapes change every step; one relaxed trace serves them all
            dist_step = tf.function(dist_step, reduce_retracing=True)
        for features, labels in batches:
            ref_step(to_tensors(features), tf.constant(labels))
            dist_step(to_tensors(features, lo, hi), tf.constant(labels[lo:hi]))

        gathered = model.embedding.get_weights(all_ranks=True)
        for t, (got, layer) in enumerate(zip(gathered, reference.tables)):
            self.assertAllClose(got, layer.embeddings.numpy(), atol=1e-5, rtol=1e-5,
                                msg=f"table {tables[t][0]} after {STEPS} steps")
        for got, want in zip(model.head.get_weights(), reference.head.get_weights()):
            self.assertAllClose(got, want, atol=1e-5, rtol=1e-5, msg="dense head")
        # the tables really moved, so the comparison above is not trivially true
        self.assertGreater(
            max(np.abs(g - w).max() for g, w in zip(gathered, full_tables)), 1e-3)

    def _meshes(self):
        return hc.meshes_for_this_keras(mesh_lib.distinct_meshes(_world()))

    def test_sgd_parity_every_mesh(self):
        tfhybrid.init(model_parallel=1)  # initialises Horovod, so _world() is right
        mesh_lib.reset()
        for m, layout in self._meshes():
            with self.subTest(model_parallel=m, layout=layout):
                self._run(m, layout, "sgd", use_function=False)
            mesh_lib.reset()

    def test_sgd_parity_in_tf_function(self):
        # The same step traced into a graph, with M = N so positions own different shards
        # and build different graphs: Horovod must still match every collective by name.
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        self._run(world, "model_major", "sgd", use_function=True)

    def test_adagrad_parity_every_mesh(self):
        tfhybrid.init(model_parallel=1)
        mesh_lib.reset()
        for m, layout in self._meshes():
            with self.subTest(model_parallel=m, layout=layout):
                self._run(m, layout, "adagrad", use_function=False)
            mesh_lib.reset()


class BytesTest(tf.test.TestCase):
    """The planner's byte model is the layer's wire format, to the byte."""

    def tearDown(self):
        collectives.stop_counting_traffic()
        mesh_lib.reset()
        super().tearDown()

    def test_measured_alltoall_bytes_equal_the_plan(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=world)
        tables = [Embedding(400, 12, combiner="sum", name="cols"),
                  Embedding(90, 6, combiner="mean", name="whole"),
                  tf.keras.layers.Embedding(80, 5, name="unpooled"),
                  Embedding(20, 4, combiner="sum", name="replicated")]
        layer = DistributedEmbedding(tables, mesh=mesh, column_slice_threshold=2500,
                                     data_parallel_threshold=100,
                                     input_table_map=[0, 1, 2, 3, 1])
        rng = np.random.default_rng(mesh.rank)
        ids = [tf.constant(rng.integers(0, rows, size=[6, h]))
               for rows, h in ((400, 3), (90, 2), (80, 2), (20, 1), (90, 4))]
        head = tf.keras.layers.Dense(1)
        traffic = collectives.count_traffic()
        for v in traffic.values():
            v.assign(0)
        with tf.GradientTape() as tape:
            out = layer(ids)
            loss = tf.reduce_sum(head(tf.concat(
                [tf.reshape(o, [6, -1]) for o in out], axis=1)))
        tape.gradient(loss, layer.trainable_variables)
        plan = layer.plan.ranks[mesh.model_position]
        self.assertEqual(int(traffic["alltoall"].numpy()), int(plan.alltoall_bytes_per_step))
        if world > 1:
            self.assertGreater(plan.alltoall_bytes_per_step, 0)


class IdleRanksTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_ranks_that_own_no_table_still_take_part(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=world)
        layer = DistributedEmbedding([Embedding(40, 4, combiner="sum", name="only")],
                                     mesh=mesh)
        head = tf.keras.layers.Dense(1)
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), mesh=mesh)
        ids = [tf.constant([[1, 2], [3, 4]])]
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(head(layer(ids)[0]))
            variables = layer.trainable_variables + head.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        owned = [v for v in layer.trainable_variables if "shard" in v.name]
        self.assertLen(owned, 1 if mesh.model_position == 0 else 0)
        self.assertLen(layer.get_weights(all_ranks=True), 1)


class BadInputTest(tf.test.TestCase):
    """Bad input on one rank fails on every rank, with the values named; never a hang."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _layer(self, mesh):
        layer = DistributedEmbedding(
            [Embedding(50, 4, combiner="sum", name="user"),
             Embedding(30, 4, combiner="sum", name="item")], mesh=mesh)
        return layer

    def test_out_of_range_id_names_table_and_id(self):
        mesh = tfhybrid.init(model_parallel=_world())
        layer = self._layer(mesh)
        bad_rank = mesh.size - 1
        user = np.array([[1, 2], [3, 4]])
        item = np.array([[1, 2], [3, 77 if mesh.rank == bad_rank else 4]])
        layer([tf.constant(user), tf.constant(user % 30)])  # builds it
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    rf"table 'item' got id 77 on rank {bad_rank}; "
                                    r"expected ids in \[0, 30\)"):
            layer([tf.constant(user), tf.constant(item)])
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"table 'user' got id -1 on rank 0"):
            layer([tf.constant(-user if mesh.rank == 0 else user), tf.constant(user % 30)])

    def test_uneven_batches_name_ranks_and_sizes(self):
        mesh = tfhybrid.init(model_parallel=_world())
        layer = self._layer(mesh)
        layer([tf.constant([[1, 2]]), tf.constant([[1, 2]])])
        batch = 3 if mesh.rank == 0 and mesh.size > 1 else 2
        ids = tf.constant(np.ones([batch, 2], np.int64))
        if mesh.size == 1:
            self.assertLen(layer([ids, ids]), 2)  # one rank cannot disagree with itself
            return
        sizes = " ".join(["3"] + ["2"] * (mesh.size - 1))
        with self.assertRaisesRegex(
                tf.errors.InvalidArgumentError,
                rf"batch sizes differ across ranks; batch size of rank 0..{mesh.size - 1}: "
                rf"\[{sizes}\]"):
            layer([ids, ids])


class ConfigTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_get_config_round_trip(self):
        mesh = tfhybrid.init(model_parallel=_world())
        layer = DistributedEmbedding(
            [Embedding(50, 4, combiner="mean", name="user"),
             tf.keras.layers.Embedding(30, 3, name="item")],
            mesh=mesh, strategy="memory_optimized", column_slice_threshold=100,
            input_table_map=[0, 1, 0])
        config = layer.get_config()
        clone = DistributedEmbedding.from_config(config)
        self.assertEqual(clone.get_config(), config)
        self.assertEqual(config["input_table_map"], [0, 1, 0])
        self.assertEqual(config["embeddings"][0]["config"]["combiner"], "mean")

    def test_a_given_plan_is_executed_as_it_is(self):
        mesh = tfhybrid.init(model_parallel=_world())
        tables = [Embedding(500, 8, combiner="sum", name="user"),
                  Embedding(40, 4, combiner="sum", name="item")]
        configs = [planning.TableConfig("user", 500, 8), planning.TableConfig("item", 40, 4)]
        plan = planning.plan_sharding(configs, mesh.data_parallel, mesh.model_parallel,
                                     strategy="basic", optimizer="rowwise_adagrad",
                                     column_slice_threshold=1000)
        path = os.path.join(self.get_temp_dir(), "plan.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        for given in (plan, plan.to_json(), path):
            layer = DistributedEmbedding(tables, mesh=mesh, plan=given,
                                         column_slice_threshold=10)  # unused: plan given
            layer([tf.constant([[1, 2]] * 2), tf.constant([[3, 4]] * 2)])
            self.assertEqual(layer.plan, plan)
            self.assertEqual(layer.strategy, "basic")
        # the plan survives get_config, so a rebuilt layer executes the same plan
        clone = DistributedEmbedding.from_config(layer.get_config())
        clone([tf.constant([[1, 2]] * 2), tf.constant([[3, 4]] * 2)])
        self.assertEqual(clone.plan, plan)
        # a plan for another mesh or other tables is refused, naming both
        other = planning.plan_sharding(configs, mesh.size + 1, 1)
        with self.assertRaisesRegex(ValueError, rf"plan is for a D x M = {mesh.size + 1} x 1"):
            DistributedEmbedding(tables, mesh=mesh, plan=other)([tf.constant([[1]])] * 2)
        with self.assertRaisesRegex(ValueError, r"plan's tables .* are not this layer's"):
            DistributedEmbedding([Embedding(501, 8, name="user"), Embedding(40, 4, name="item")],
                                 mesh=mesh, plan=plan)([tf.constant([[1]])] * 2)
        with self.assertRaisesRegex(ValueError, r"plan='/nonexistent.json' is neither"):
            DistributedEmbedding(tables, plan="/nonexistent.json")
        with self.assertRaisesRegex(ValueError, r"strategy='cost' needs the cluster"):
            DistributedEmbedding(tables, strategy="cost")

    def test_a_cost_plan_runs_on_the_mesh_it_chose(self):
        # the planner picks M and the layout for this many ranks (a slow link between
        # one-rank nodes); the layer executes that plan on the mesh started from it
        world = _world()
        configs = (planning.TableConfig("user", 4000, 8), planning.TableConfig("item", 300, 4))
        rates = planning.ComputeRates(1e9, {"rowwise_adagrad": 1e9})
        cluster = planning.ClusterSpec(world, 1, 1e10, 1e7, 0.0, 0.0, 1 << 30, rates)
        workload = planning.Workload(configs, local_batch_size=2)
        plan, layout, prediction = planning.plan_for_cluster(configs, cluster, workload)
        self.assertEqual(plan.strategy, "cost")
        self.assertIn("predicted by the cost model", plan.describe())
        mesh = tfhybrid.init(model_parallel=plan.model_parallel, layout=layout)
        layer = DistributedEmbedding([Embedding(4000, 8, combiner="sum", name="user"),
                                      Embedding(300, 4, combiner="sum", name="item")],
                                     mesh=mesh, plan=plan.to_json())
        user, item = layer([tf.constant([[1, 2], [3, 4]]), tf.constant([[5], [6]])])
        self.assertEqual((user.shape, item.shape), ((2, 8), (2, 4)))
        self.assertEqual(layer.plan, plan)
        self.assertGreater(prediction.step_seconds, 0)

    def test_the_plan_counts_the_tables_optimizer_state(self):
        mesh = tfhybrid.init(model_parallel=_world())
        tables = [Embedding(500, 8, name="user"), Embedding(40, 4, name="item")]
        stateless = DistributedEmbedding(tables, mesh=mesh)
        rowwise = DistributedEmbedding(tables, mesh=mesh, optimizer="rowwise_adagrad")
        for layer in (stateless, rowwise):
            layer([tf.constant([[1]]), tf.constant([[2]])])
        # row-wise AdaGrad keeps one float32 per row
        self.assertEqual(sum(r.optimizer_bytes for r in stateless.plan.ranks), 0)
        self.assertEqual(sum(r.optimizer_bytes for r in rowwise.plan.ranks), (500 + 40) * 4)
        with self.assertRaisesRegex(ValueError, r"optimizer='lamb' is unknown"):
            DistributedEmbedding(tables, optimizer="lamb")

    def test_bad_arguments_raise_value_error(self):
        with self.assertRaisesRegex(ValueError, r"strategy='fastest' is unknown"):
            DistributedEmbedding([Embedding(5, 2)], strategy="fastest")
        with self.assertRaisesRegex(ValueError, r"input_table_map\[1\]=3 is not a table"):
            DistributedEmbedding([Embedding(5, 2)], input_table_map=[0, 3])
        with self.assertRaisesRegex(ValueError, r"dp_input='no' must be True"):
            DistributedEmbedding([Embedding(5, 2)], dp_input="no")
        # the planner's options are checked when the layer is made, not at its first batch
        with self.assertRaisesRegex(ValueError, r"column_slice_threshold must be an int "
                                                r">= 1, got -3"):
            DistributedEmbedding([Embedding(5, 2)], column_slice_threshold=-3)
        with self.assertRaisesRegex(ValueError, r"combiner='max' is unknown"):
            Embedding(5, 2, combiner="max")


if __name__ == "__main__":
    tf.test.main()
