"""A keras-rs DCN model written once, built with keras-rs's ``DistributedEmbedding`` or
with ``tfhybrid.keras_rs.DistributedEmbedding`` (the one import a migration changes).

The features come in a nested dict: ``user`` ids ``[batch]`` ("sum"), ``items.seen``
``[batch, 3]`` and ``items.next`` ``[batch, 1]`` sharing the ``item`` table ("mean"),
ragged ``words`` with empty bags ("sqrtn"), ``country`` ``[batch]`` ("mean"), beside
dense features. Every table and dense layer starts from a seeded initializer (a
shape-dependent ``VarianceScaling`` among them), so both builds start from the same
weights on any mesh. The embeddings are concatenated into a DCN tower (keras-rs's
``FeatureCross``). Samples are rows of one global array: rank r of N feeds rows
``[r * local, (r + 1) * local)`` of each global batch of ``N * local`` rows.
"""

from __future__ import annotations

import keras
import keras_rs
import numpy as np
import tensorflow as tf

DENSE = 3
# the planner's thresholds (elements) that give every kind of placement on M = 2: user
# (96 x 3 = 288) row-sliced, item (64 x 4 = 256) column-sliced, words (40 x 2) table-wise,
# country (10 x 2) replicated
SHARDING = dict(data_parallel_threshold=30, row_slice_threshold=270,
                column_slice_threshold=200)
VOCABULARY = {"user": 96, "item": 64, "words": 40, "country": 10}
# an optimizer of its own for each table, the four keras-rs honours (makers: a new one
# each call); the item table's clips its gradient's norm (by the whole table's norm,
# which is a shard's in none of the 2 x 2 layouts: column-sliced there)
MIXED_OPTIMIZERS = {
    "user": lambda: keras.optimizers.SGD(0.1),
    "item": lambda: keras.optimizers.Adagrad(0.2, clipnorm=0.01),
    "words": lambda: keras.optimizers.Adam(0.05),
    "country": lambda: keras.optimizers.Ftrl(0.2, l1_regularization_strength=0.01),
}


def feature_configs(batch: int | None = None, optimizer: object = "adam") -> dict:
    """The features; every table names ``optimizer`` (keras-rs's default: "adam"), or,
    a dict, the table's ``optimizer[table name]``."""
    def table(**fields):
        own = optimizer[fields["name"]] if isinstance(optimizer, dict) else optimizer
        return keras_rs.layers.TableConfig(optimizer=own, **fields)
    feature = keras_rs.layers.FeatureConfig
    user = table(name="user", vocabulary_size=96, embedding_dim=3, combiner="sum",
                 initializer=keras.initializers.RandomNormal(seed=11))
    item = table(name="item", vocabulary_size=64, embedding_dim=4, combiner="mean",
                 initializer=keras.initializers.VarianceScaling(mode="fan_out", seed=12))
    words = table(name="words", vocabulary_size=40, embedding_dim=2, combiner="sqrtn",
                  initializer=keras.initializers.TruncatedNormal(seed=13))
    country = table(name="country", vocabulary_size=10, embedding_dim=2, combiner="mean",
                    initializer=keras.initializers.RandomUniform(seed=14),
                    placement="default_device")
    return {
        "user": feature("user", user, (batch,), (batch, 3)),
        "items": {"seen": feature("seen", item, (batch, 3), (batch, 4)),
                  "next": feature("next", item, (batch, 1), (batch, 4))},
        "words": feature("words", words, (batch, None), (batch, 2)),
        "country": feature("country", country, (batch,), (batch, 2)),
    }


def data(samples: int, seed: int = 0, weighted: bool = False) -> tuple[dict, np.ndarray]:
    """``samples`` rows of every input, and labels in [0, 1]; ``weighted``: with
    ``x["weights"]``, a positive weight beside every id, in the ids' nesting."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, samples)          # some bags empty
    words = tf.RaggedTensor.from_row_lengths(
        rng.integers(0, VOCABULARY["words"], int(lengths.sum())).astype(np.int32), lengths)
    ids = {"user": rng.integers(0, VOCABULARY["user"], samples).astype(np.int32),
           "items": {"seen": rng.integers(0, VOCABULARY["item"], [samples, 3]).astype(np.int32),
                     "next": rng.integers(0, VOCABULARY["item"], [samples, 1]).astype(np.int32)},
           "words": words,
           "country": rng.integers(0, VOCABULARY["country"], samples).astype(np.int32)}
    x = {"ids": ids, "dense": rng.normal(size=[samples, DENSE]).astype(np.float32)}
    y = rng.uniform(size=[samples, 1]).astype(np.float32)
    if weighted:
        def like(v):
            if isinstance(v, tf.RaggedTensor):
                return v.with_flat_values(rng.uniform(
                    0.25, 2.0, v.flat_values.shape[0]).astype(np.float32))
            return rng.uniform(0.25, 2.0, v.shape).astype(np.float32)
        x["weights"] = tf.nest.map_structure(like, ids)
    return x, y


def tensors(x: dict) -> dict:
    """``x`` with its arrays as tensors (a Keras 3 model takes no mix of both)."""
    return tf.nest.map_structure(
        lambda v: v if isinstance(v, tf.RaggedTensor) else tf.convert_to_tensor(v), x)


def rows(x: dict, start: int, stop: int) -> dict:
    """Rows [start, stop) of every input of ``x``."""
    return tf.nest.map_structure(lambda v: v[start:stop], x)


def local_share(x: dict, y: np.ndarray, batch: int, rank: int, world: int) -> tuple:
    """Rank ``rank``'s share of every global batch of ``batch * world`` rows, in order."""
    steps = len(y) // (batch * world)
    parts = [(s * world + rank) * batch for s in range(steps)]
    take = np.concatenate([np.arange(p, p + batch) for p in parts])
    pick = lambda v: tf.gather(v, take) if isinstance(v, tf.RaggedTensor) else v[take]  # noqa: E731
    return tf.nest.map_structure(pick, x), y[take]


def _inputs(dtype: str, suffix: str = "") -> dict:
    return {"user": keras.Input((), dtype=dtype, name="user" + suffix),
            "items": {"seen": keras.Input((3,), dtype=dtype, name="seen" + suffix),
                      "next": keras.Input((1,), dtype=dtype, name="next" + suffix)},
            "words": keras.Input((None,), dtype=dtype, ragged=True, name="words" + suffix),
            "country": keras.Input((), dtype=dtype, name="country" + suffix)}


def model(embedding_class, configs: dict, weighted: bool = False,
          **layer_kwargs) -> tuple[keras.Model, object]:
    """The DCN model with ``embedding_class(configs, **layer_kwargs)``; the same seeded
    dense weights whichever embedding class. ``weighted``: the ids' weights are an input
    too (``x["weights"]``), handed to the embedding beside the ids."""
    ids = _inputs("int32")
    weights = _inputs("float32", "_weights") if weighted else None
    dense = keras.Input((DENSE,), name="dense")
    embedding = embedding_class(configs, **layer_kwargs)
    embedded = embedding(ids, weights) if weighted else embedding(ids)
    bottom = keras.layers.Dense(4, activation="relu", name="bottom",
                                kernel_initializer=keras.initializers.GlorotUniform(seed=21))
    x0 = keras.layers.Concatenate(name="joined")(keras.tree.flatten(embedded) + [bottom(dense)])
    crossed = keras_rs.layers.FeatureCross(
        name="cross", kernel_initializer=keras.initializers.GlorotUniform(seed=22))(x0)
    hidden = keras.layers.Dense(6, activation="relu", name="hidden",
                                kernel_initializer=keras.initializers.GlorotUniform(seed=23))(
        crossed)
    logit = keras.layers.Dense(1, name="logit",
                               kernel_initializer=keras.initializers.GlorotUniform(seed=24))(
        hidden)
    inputs = {"ids": ids, "dense": dense}
    if weighted:
        inputs["weights"] = weights
    return keras.Model(inputs, logit), embedding


def dataset(x: dict, y: np.ndarray, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def dense_weights(model: keras.Model) -> list:
    """The weights of the dense layers (the embedding's aside), in a fixed order."""
    return [w for name in ("bottom", "cross", "hidden", "logit")
            for w in model.get_layer(name).get_weights()]


def train_reference(model: keras.Model, layer: object, x: dict, y: np.ndarray, batch: int,
                    dense_optimizer: object, table_optimizer: object = None) -> dict:
    """keras-rs's model trained in one process on ``batch``-row batches of ``x``, ``y``:
    the dense layers by ``dense_optimizer``, each table by a new optimizer of its own from
    ``table_optimizer()`` (or, a dict, from ``table_optimizer[table name]()``), as
    keras-rs trains them on TPUs, or by ``dense_optimizer`` where that is None (as
    keras-rs on CPUs). keras-rs's CPU layer trains its tables with the model's optimizer
    whatever their configs say, so the tables' own optimizers are applied here by hand,
    each to its table's variable. Returns them by table name."""
    tables = {v.path: v for v in layer.trainable_variables}
    dense = [v for v in model.trainable_variables if v.path not in tables]
    # keras-rs's table variables are "<layer>/<table name>/embeddings"
    make = ((lambda path: table_optimizer[path.split("/")[-2]]())
            if isinstance(table_optimizer, dict) else lambda path: table_optimizer())
    owners = {path: make(path) for path in tables} if table_optimizer else {}
    for path, optimizer in owners.items():
        optimizer.build([tables[path]])
    dense_optimizer.build(dense + ([] if owners else list(tables.values())))

    @tf.function
    def step(x, y):
        variables = dense + list(tables.values())
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
        grads = dict(zip([v.path for v in variables], tape.gradient(loss, variables)))
        if not owners:
            dense_optimizer.apply_gradients([(grads[v.path], v) for v in variables])
            return
        dense_optimizer.apply_gradients([(grads[v.path], v) for v in dense])
        for path, optimizer in owners.items():
            # each row's gradient summed first: Keras applies a gradient's slices one by
            # one, and Adagrad's or FTRL's squares of a row's slices are not the square
            # of its gradient
            optimizer.apply_gradients([(tf.convert_to_tensor(grads[path]), tables[path])])

    for start in range(0, len(y), batch):
        step(tensors(rows(x, start, start + batch)), y[start:start + batch])
    return {path.split("/")[-2]: optimizer for path, optimizer in owners.items()}


def slots(optimizer: object, table: object) -> dict:
    """``optimizer``'s slots of the variable ``table`` by slot name, as numpy (Keras 3
    names a slot "<variable path, / as _>_<slot>")."""
    prefix = table.path.replace("/", "_") + "_"
    return {v.name[len(prefix):]: np.asarray(v) for v in optimizer.variables
            if v.name.startswith(prefix)}


def tables(embedding) -> dict:
    """Every table whole by name, as numpy (a collective for tfhybrid's layer)."""
    return {name: np.asarray(value) for name, value in embedding.get_embedding_tables().items()}
