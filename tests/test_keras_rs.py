"""tfhybrid.keras_rs.DistributedEmbedding against keras-rs's own layer, in one process.

A keras-rs DCN model (tests/_keras_rs_case.py) built with keras-rs's
``DistributedEmbedding`` and with tfhybrid's (one import changed) gives the same outputs
from the same seeded tables, and the same tables and dense weights after ``fit``; sparse
ids, a single feature, the stand-in configs, the config round trip, and every bad config
raising ``ValueError`` naming its value. (2 x 2: tests/test_keras_rs_distributed.py.)
"""

import logging
import os
import re
import textwrap

import keras
import keras_rs
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import keras_rs as tk
from tfhybrid import mesh as mesh_lib
from tests import _keras_rs_case as case

KERAS = (3,)        # keras-rs needs Keras 3
TOLERANCE = 1e-6
LEARNING_RATE = 0.05


class KerasRsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        mesh_lib.reset()
        tfhybrid.init(model_parallel=1)

    def test_outputs_and_fit_equal_keras_rs(self):
        configs = case.feature_configs()
        x, y = case.data(64)
        theirs, their_layer = case.model(keras_rs.layers.DistributedEmbedding, configs)
        ours, our_layer = case.model(tk.DistributedEmbedding, configs)
        inputs = case.tensors(x)
        self.assertAllClose(ours(inputs), theirs(inputs), atol=TOLERANCE, rtol=0)
        self._assert_tables_equal(case.tables(our_layer), case.tables(their_layer))
        for model in (theirs, ours):
            model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
            model.fit(case.dataset(x, y, 16), epochs=1, verbose=0)
        trained = case.tables(our_layer)
        self._assert_tables_equal(trained, case.tables(their_layer))
        self.assertAllClose(case.dense_weights(ours), case.dense_weights(theirs),
                            atol=TOLERANCE, rtol=0)
        # the tables moved (the comparison is not of untouched tables)
        self.assertGreater(np.abs(trained["words"]
                                  - self._initial("words", configs)).max(), 1e-4)
        self.assertAllClose(ours(inputs), theirs(inputs), atol=TOLERANCE, rtol=0)

    def _initial(self, name, configs):
        table = [f.table for f in keras.tree.flatten(configs) if f.table.name == name][0]
        return np.asarray(table.initializer((table.vocabulary_size, table.embedding_dim)))

    def _assert_tables_equal(self, ours, theirs):
        self.assertEqual(sorted(ours), sorted(theirs))
        for name in theirs:
            self.assertAllClose(ours[name], theirs[name], atol=TOLERANCE, rtol=0, msg=name)

    def test_weighted_features_equal_keras_rs(self):
        # per-id weights beside every feature: "sum" of [batch] ids scales the row,
        # weighted "mean" of [batch, 3] and [batch, 1] bags, weighted "sqrtn" of ragged
        # bags, and a "mean" of [batch] ids (its weight changes nothing, as in keras-rs)
        configs = case.feature_configs()
        x, y = case.data(32, seed=4, weighted=True)
        theirs, their_layer = case.model(keras_rs.layers.DistributedEmbedding, configs,
                                         weighted=True)
        ours, our_layer = case.model(tk.DistributedEmbedding, configs, weighted=True)
        ids, weights = case.tensors(x["ids"]), case.tensors(x["weights"])
        for a, b in zip(tf.nest.flatten(our_layer(ids, weights)),
                        tf.nest.flatten(their_layer(ids, weights))):
            self.assertAllClose(a, b, atol=TOLERANCE, rtol=0)
        # the weights count: the weighted sqrtn bags are not the unweighted ones
        self.assertGreater(np.abs(our_layer(ids, weights)["words"]
                                  - our_layer(ids)["words"]).max(), 1e-3)
        for model in (theirs, ours):
            model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
            model.fit(case.dataset(x, y, 16), epochs=1, verbose=0)
        self._assert_tables_equal(case.tables(our_layer), case.tables(their_layer))
        self.assertAllClose(case.dense_weights(ours), case.dense_weights(theirs),
                            atol=TOLERANCE, rtol=0)

    def test_weights_that_do_not_match_their_ids_raise_value_error(self):
        layer = tk.DistributedEmbedding(case.feature_configs())
        x, _ = case.data(4, weighted=True)
        ids, weights = case.tensors(x["ids"]), case.tensors(x["weights"])
        layer(ids, weights)
        bad = [
            (dict(weights, words=tf.ones([4, 3])), "'words'.*RaggedTensor"),
            (dict(weights, items=dict(weights["items"], seen=tf.ones([4, 2]))),
             "'items.seen'.*shape"),
        ]
        for given, named in bad:
            with self.subTest(named=named):
                with self.assertRaisesRegex(ValueError, named):
                    layer(ids, given)

    def test_a_subclassed_model_fits_as_keras_rs(self):
        # keras-rs's DLRM example's form: the layer made in __init__ (with keras-rs's
        # table_stacking and dtype), first called inside fit's traced step, where this
        # layer builds and draws its tables
        class Model(keras.Model):
            def __init__(self, embedding_class):
                super().__init__()
                self.bottom = keras.layers.Dense(
                    4, kernel_initializer=keras.initializers.GlorotUniform(seed=1))
                self.embedding_layer = embedding_class(
                    feature_configs=case.feature_configs(), table_stacking="auto",
                    dtype="float32", name="embedding_layer")
                self.top = keras.layers.Dense(
                    1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))

            def call(self, inputs):
                embedded = keras.tree.flatten(self.embedding_layer(inputs["ids"]))
                return self.top(keras.ops.concatenate(
                    [self.bottom(inputs["dense"]), *embedded], axis=-1))

        x, y = case.data(32, seed=6)
        trained = []
        for cls in (keras_rs.layers.DistributedEmbedding, tk.DistributedEmbedding):
            model = Model(cls)
            model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
            model.fit(case.dataset(x, y, 8), verbose=0)
            trained.append(case.tables(model.embedding_layer))
        self._assert_tables_equal(trained[1], trained[0])

    def test_a_custom_loop_trains_as_keras_rs(self):
        configs = case.feature_configs()
        x, y = case.data(32, seed=3)
        x = case.tensors(x)
        trained = []
        for cls in (keras_rs.layers.DistributedEmbedding, tk.DistributedEmbedding):
            model, layer = case.model(cls, configs)
            optimizer = keras.optimizers.SGD(LEARNING_RATE)

            @tf.function
            def step(x, y, model=model, optimizer=optimizer):
                with tf.GradientTape() as tape:
                    loss = keras.losses.mean_squared_error(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

            for s in range(4):
                step(case.rows(x, 8 * s, 8 * s + 8), y[8 * s:8 * s + 8])
            trained.append(case.tables(layer))
        self._assert_tables_equal(trained[1], trained[0])

    def test_honoured_table_optimizers_train_each_table_as_its_own(self):
        makers = {"Adagrad": lambda: keras.optimizers.Adagrad(0.2),
                  "Ftrl": lambda: keras.optimizers.Ftrl(0.2, l1_regularization_strength=0.01)}
        for name, make in makers.items():
            with self.subTest(optimizer=name):
                configs = case.feature_configs(optimizer=make())
                x, y = case.data(32, seed=5)
                reference, theirs = case.model(keras_rs.layers.DistributedEmbedding, configs)
                case.train_reference(reference, theirs, x, y, 8,
                                     keras.optimizers.SGD(LEARNING_RATE), make)
                ours, layer = case.model(tk.DistributedEmbedding, configs,
                                         table_optimizers="honour")
                self.assertIsInstance(layer.table_optimizer, getattr(keras.optimizers, name))
                ours.compile(optimizer=tfhybrid.DistributedOptimizer(
                    keras.optimizers.SGD(LEARNING_RATE),
                    embedding_optimizer=layer.table_optimizer), loss="mse")
                ours.fit(case.dataset(x, y, 8), verbose=0)
                # the planner counted the honoured optimizer's state
                self.assertEqual(layer.plan.optimizer, {"Adagrad": "adagrad",
                                                        "Ftrl": "adam"}[name])
                self._assert_tables_equal(case.tables(layer), case.tables(theirs))
                self.assertAllClose(case.dense_weights(ours), case.dense_weights(reference),
                                    atol=TOLERANCE, rtol=0)

    def test_tables_naming_different_optimizers_train_each_with_its_own(self):
        configs = case.feature_configs(
            optimizer={name: make() for name, make in case.MIXED_OPTIMIZERS.items()})
        x, y = case.data(32, seed=5)
        reference, theirs = case.model(keras_rs.layers.DistributedEmbedding, configs)
        case.train_reference(reference, theirs, x, y, 8, keras.optimizers.SGD(LEARNING_RATE),
                             case.MIXED_OPTIMIZERS)
        ours, layer = case.model(tk.DistributedEmbedding, configs, table_optimizers="honour")
        per_table = layer.table_optimizer
        self.assertIsInstance(per_table, tfhybrid.table_optimizers.TableOptimizers)
        self.assertEqual({name: type(o).__name__ for name, o in per_table.by_table.items()},
                         {"user": "SGD", "item": "Adagrad", "words": "Adam",
                          "country": "Ftrl"})
        ours.compile(optimizer=tfhybrid.DistributedOptimizer(
            keras.optimizers.SGD(LEARNING_RATE), embedding_optimizer=per_table), loss="mse")
        ours.fit(case.dataset(x, y, 8), verbose=0)
        # the planner counted the largest state of the tables' optimizers (Adam's)
        self.assertEqual(layer.plan.optimizer, "adam")
        trained = case.tables(layer)
        self._assert_tables_equal(trained, case.tables(theirs))
        self.assertAllClose(case.dense_weights(ours), case.dense_weights(reference),
                            atol=TOLERANCE, rtol=0)
        for name in trained:   # every table trained
            self.assertGreater(np.abs(trained[name] - self._initial(name, configs)).max(),
                               1e-4, name)

        # a weights file round-trips every table's optimizer state: a new model and
        # optimizer loaded from it hold the same state
        path = os.path.join(self.get_temp_dir(), "mixed.weights.h5")
        ours.save_weights(path)
        again, again_layer = case.model(tk.DistributedEmbedding, configs,
                                        table_optimizers="honour")
        optimizer = tfhybrid.DistributedOptimizer(
            keras.optimizers.SGD(LEARNING_RATE),
            embedding_optimizer=again_layer.table_optimizer)
        again.compile(optimizer=optimizer, loss="mse")
        again.load_weights(path)
        optimizer.build(again.trainable_variables)
        self._assert_tables_equal(case.tables(again_layer), trained)
        for name, saved in per_table.by_table.items():
            loaded = optimizer.embedding_optimizer.by_table[name]
            want = [np.asarray(v) for v in saved.variables]
            got = [np.asarray(v) for v in loaded.variables]
            self.assertEqual([w.shape for w in got], [w.shape for w in want], name)
            for g, w in zip(got, want):
                self.assertAllEqual(g, w, msg=name)
            # the state holds slots of the table's shape, where the optimizer keeps any
            # (SGD keeps none)
            if name != "user":
                self.assertIn(trained[name].shape, [w.shape for w in want], name)

    def test_sparse_ids_equal_keras_rs(self):
        table = keras_rs.layers.TableConfig(
            name="t", vocabulary_size=20, embedding_dim=3, combiner="sqrtn",
            initializer=keras.initializers.RandomNormal(seed=5))
        configs = [keras_rs.layers.FeatureConfig("f", table, (4, 5), (4, 3))]
        # gaps between columns, an empty row, rows given out of order
        ids = tf.SparseTensor([[2, 4], [0, 1], [0, 3], [3, 0], [3, 2], [3, 4]],
                              [7, 1, 2, 3, 4, 5], [4, 5])
        weights = tf.SparseTensor(ids.indices, [0.5, 1.0, 2.0, 1.5, 0.25, 3.0], [4, 5])
        theirs_layer = keras_rs.layers.DistributedEmbedding(configs)
        ours_layer = tk.DistributedEmbedding(configs)
        for given in (None, weights):
            with self.subTest(weighted=given is not None):
                theirs = theirs_layer([tf.sparse.reorder(ids)], None if given is None
                                      else [tf.sparse.reorder(given)])
                ours = ours_layer([ids], None if given is None else [given])
                self.assertIsInstance(ours, list)
                self.assertAllClose(ours[0], theirs[0], atol=TOLERANCE, rtol=0)
                self.assertAllClose(ours[0][1], tf.zeros([3]))
        elsewhere = tf.SparseTensor([[0, 0], [0, 1], [0, 3], [3, 0], [3, 2], [3, 4]],
                                    [1.0] * 6, [4, 5])
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "'0'.*indices"):
            ours_layer([ids], [elsewhere])

    def test_a_model_of_sparse_inputs_fits_as_keras_rs(self):
        table = keras_rs.layers.TableConfig(
            name="t", vocabulary_size=20, embedding_dim=3, combiner="mean",
            initializer=keras.initializers.RandomNormal(seed=1))
        configs = {"a": keras_rs.layers.FeatureConfig("a", table, (None, 5), (None, 3))}
        rng = np.random.default_rng(0)
        # 32 rows of 1 to 3 ids at scattered columns, a weight beside each
        indices = [[i, c] for i in range(32)
                   for c in sorted(rng.choice(5, rng.integers(1, 4), replace=False))]
        ids = tf.SparseTensor(np.array(indices, np.int64),
                              rng.integers(0, 20, len(indices)).astype(np.int32), [32, 5])
        weights = tf.SparseTensor(ids.indices, rng.uniform(0.5, 2.0, len(indices)).astype(
            np.float32), [32, 5])
        y = rng.uniform(size=[32, 1]).astype(np.float32)
        trained = []
        for cls in (keras_rs.layers.DistributedEmbedding, tk.DistributedEmbedding):
            inputs = ({"a": keras.Input((5,), dtype="int32", sparse=True, name="a")},
                      {"a": keras.Input((5,), dtype="float32", sparse=True, name="w")})
            layer = cls(configs)
            logit = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(
                seed=3))(layer(*inputs)["a"])
            model = keras.Model(inputs, logit)
            model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
            model.fit(tf.data.Dataset.from_tensor_slices((({"a": ids}, {"a": weights}), y))
                      .batch(8), verbose=0)
            trained.append(case.tables(layer))
        self._assert_tables_equal(trained[1], trained[0])
        self.assertGreater(np.abs(trained[1]["t"] - table.initializer((20, 3))).max(), 1e-4)

    def test_a_single_feature_is_returned_alone(self):
        table = keras_rs.layers.TableConfig(name="t", vocabulary_size=20, embedding_dim=3,
                                            combiner="sum")
        feature = keras_rs.layers.FeatureConfig("f", table, (2, 2), (2, 3))
        ids = tf.constant([[1, 2], [3, 4]])
        theirs = keras_rs.layers.DistributedEmbedding(feature)
        ours = tk.DistributedEmbedding(feature)
        # the same (unseeded, shared) initializer instance draws the same table
        self.assertAllClose(ours(ids), theirs(ids), atol=TOLERANCE, rtol=0)

    def test_stand_in_configs_equal_keras_rs_configs(self):
        def configs(table_class, feature_class):
            table = table_class(name="t", vocabulary_size=30, embedding_dim=4,
                                combiner="mean",
                                initializer=keras.initializers.RandomUniform(seed=3))
            return {"a": feature_class("a", table, (3, 2), (3, 4)),
                    "b": feature_class("b", table, (3,), (3, 4))}
        ids = {"a": tf.constant([[1, 2], [3, 4], [5, 6]]), "b": tf.constant([7, 8, 9])}
        theirs = keras_rs.layers.DistributedEmbedding(
            configs(keras_rs.layers.TableConfig, keras_rs.layers.FeatureConfig))(ids)
        layer = tk.DistributedEmbedding(configs(tk.TableConfig, tk.FeatureConfig))
        self.assertAllClose(layer(ids), theirs, atol=TOLERANCE, rtol=0)
        self.assertEqual(len(layer.sharded.table_specs), 1)   # "a" and "b" share it

    def test_get_config_round_trips(self):
        configs = case.feature_configs()
        layer = tk.DistributedEmbedding(configs, table_stacking=[["user", "item"]],
                                        sharding=dict(data_parallel_threshold=30),
                                        name="embedding")
        x, _ = case.data(8)
        before = layer(x["ids"])
        config = layer.get_config()
        again = tk.DistributedEmbedding.from_config(config)
        self.assertEqual(again.get_config(), config)
        self.assertEqual(config["table_stacking"], [["user", "item"]])
        self.assertEqual(config["sharding"], {"data_parallel_threshold": 30})
        # keras-rs's form: tables listed once, a shared table by its index
        self.assertEqual(len(config["tables"]), 4)
        self.assertEqual(config["feature_configs"]["items"]["seen"]["table"],
                         config["feature_configs"]["items"]["next"]["table"])
        seen, next_ = (again.feature_configs["items"][k] for k in ("seen", "next"))
        self.assertIsInstance(seen, keras_rs.layers.FeatureConfig)
        self.assertIs(seen.table, next_.table)
        # keras-rs reads tfhybrid's config, and tfhybrid keras-rs's
        keras_rs.layers.DistributedEmbedding.from_config(
            {k: v for k, v in config.items() if k not in ("sharding", "table_optimizers")})
        theirs = keras_rs.layers.DistributedEmbedding(configs, name="theirs").get_config()
        self.assertIsInstance(tk.DistributedEmbedding.from_config(theirs),
                              tk.DistributedEmbedding)
        # the seeded initializers survive: the same tables
        self.assertAllClose(again(x["ids"]), before, atol=TOLERANCE, rtol=0)

    def test_a_saved_model_loads_with_its_trained_tables(self):
        model, layer = case.model(tk.DistributedEmbedding, case.feature_configs())
        x, y = case.data(16)
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
        model.fit(case.dataset(x, y, 8), verbose=0)
        path = os.path.join(self.get_temp_dir(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)   # no custom_objects: the layer is registered
        embedding = [l for l in loaded.layers if isinstance(l, tk.DistributedEmbedding)][0]
        self._assert_tables_equal(case.tables(embedding), case.tables(layer))
        self.assertAllClose(loaded(case.tensors(x)), model(case.tensors(x)), atol=0, rtol=0)

    def test_what_is_not_used_is_logged_once(self):
        with self.assertLogs("tfhybrid.keras_rs.layer", logging.INFO) as logs:
            layer = tk.DistributedEmbedding(case.feature_configs(),
                                            pipeline_execution_with_tensor_core=True)
            x, _ = case.data(4)
            layer(x["ids"])
            layer(x["ids"])
        text = "\n".join(logs.output)
        self.assertEqual(text.count("TableConfig.optimizer"), 1, text)
        self.assertIn("['country', 'item', 'user', 'words']", text)
        self.assertEqual(text.count("pipeline_execution_with_tensor_core"), 1, text)
        self.assertEqual(text.count("placement ['default_device'] is not used"), 1, text)

    def test_bad_configs_raise_value_error_naming_the_value(self):
        table = keras_rs.layers.TableConfig
        feature = keras_rs.layers.FeatureConfig

        def one(**fields):
            t = table(**dict(dict(name="t", vocabulary_size=10, embedding_dim=2), **fields))
            return {"f": feature("f", t, (4, 2), (4, 2))}

        t1, t2 = (table(name="same", vocabulary_size=10, embedding_dim=2) for _ in range(2))
        cases = [
            (dict(feature_configs=one(combiner="max")), "'max'"),
            (dict(feature_configs=one(vocabulary_size=0)), "vocabulary_size=0"),
            (dict(feature_configs=one(embedding_dim=2.5)), "embedding_dim=2.5"),
            (dict(feature_configs=one(placement="tpu")), "'tpu'"),
            (dict(feature_configs={"a": feature("a", t1, (4,), (4, 2)),
                                   "b": feature("b", t2, (4,), (4, 2))}), "'same'"),
            (dict(feature_configs={"a": "user_ids"}), "'user_ids'"),
            (dict(feature_configs={}), "{}"),
            (dict(feature_configs={"f": feature("f", t1, (4, 2, 2), (4, 2))}),
             "(4, 2, 2)"),
            (dict(feature_configs=one(), table_stacking=[["t", "nope"]]), "['nope']"),
            (dict(feature_configs=one(), table_stacking=3), "table_stacking=3"),
            (dict(feature_configs=one(), update_stats=True), "update_stats"),
            (dict(feature_configs=one(), table_optimizers="tpu"), "'tpu'"),
            (dict(feature_configs=one(), sharding=dict(input_table_map=[0])),
             "input_table_map"),
            (dict(feature_configs=one(), sharding=dict(strategy="nope")), "'nope'"),
            (dict(feature_configs=one(optimizer="rmsprop"), table_optimizers="honour"),
             "RMSprop"),
            (dict(feature_configs=one(optimizer=None), table_optimizers="honour"),
             "optimizer=None"),
            # tables may name different optimizers, each of the four
            (dict(feature_configs={
                "a": feature("a", table(name="a", vocabulary_size=10, embedding_dim=2,
                                        optimizer="adagrad"), (4,), (4, 2)),
                "b": feature("b", table(name="b", vocabulary_size=10, embedding_dim=2,
                                        optimizer=keras.optimizers.Lion(0.1)), (4,), (4, 2))},
                table_optimizers="honour"), "table 'b': optimizer Lion"),
        ]
        for kwargs, named in cases:
            with self.subTest(named=named):
                with self.assertRaisesRegex(ValueError, re.escape(named)):
                    tk.DistributedEmbedding(**kwargs)
        with self.assertRaisesRegex(ValueError, "table_optimizers='honour'"):
            tk.DistributedEmbedding(one()).table_optimizer

    def test_the_docstring_examples_run(self):
        for cls in (tk.DistributedEmbedding, tk.TableConfig, tk.FeatureConfig,
                    tfhybrid.table_optimizers.TableOptimizers):
            with self.subTest(cls=cls.__name__):
                # "Example::" or "Example (one process; ...)::"
                parts = re.split(r"\n *Example[^\n]*::\n", cls.__doc__, maxsplit=1)
                self.assertEqual(len(parts), 2, cls.__name__)
                exec(textwrap.dedent(parts[1]), {})  # pylint: disable=exec-used

    def test_bad_inputs_raise_value_error_naming_the_feature(self):
        layer = tk.DistributedEmbedding(case.feature_configs())
        x, _ = case.data(4)
        layer(x["ids"])
        bad = [
            (dict(x["ids"], country=tf.zeros([4, 2, 2], tf.int32)), "'country'"),
            ({k: v for k, v in x["ids"].items() if k != "words"}, "'words'"),
            (dict(x["ids"], items=[x["ids"]["items"]["seen"]]), "'items'"),
        ]
        for inputs, named in bad:
            with self.subTest(named=named):
                with self.assertRaisesRegex(ValueError, named):
                    layer(inputs)


if __name__ == "__main__":
    tf.test.main()
