"""DLRM and DCN-v2 click models over a DistributedEmbedding.

Both take the training app's batches, ``{"dense": float [b, n_dense], "categorical": int
[b, n_tables]}``, and return click logits ``[b, 1]`` in float32 (also under mixed
precision, so the loss is computed in float32).

- **DLRM** (Naumov et al. 2019): bottom MLP over the dense features, one embedding per
  categorical feature, the dot products of every pair of those vectors, top MLP.
- **DCN-v2** (Wang et al. 2021): the dense features and all embeddings concatenated, a
  stack of cross layers (``tfrs.layers.dcn.Cross``'s arithmetic), then a deep tower.

``distributed=True`` shards the tables with ``tfhybrid.layers.DistributedEmbedding`` over
the mesh; ``distributed=False`` holds whole ``tf.keras.layers.Embedding`` tables in one
process (the serving copy that ``export_for_serving`` writes: no Horovod, no custom ops).
``xla=True`` compiles the dense towers with XLA; the collectives stay outside.

``dynamic_tables={feature: options}`` makes those features' tables
``tfhybrid.layers.DynamicEmbedding(embedding_dim, **options)`` (``capacity``,
``admit_after``, ``evict``, ``ttl_steps``): tables of raw int64 keys, sharded by key
inside the DistributedEmbedding. The model then takes ``categorical`` as int64, the
dynamic features' columns holding keys and the others row ids.
"""

from __future__ import annotations

import types
import zlib
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfhybrid.layers.distributed_embedding import DistributedEmbedding
from tfhybrid.layers.dynamic_embedding import DynamicEmbedding
from tfhybrid.layers.embedding import Embedding
from tfhybrid.layers.xla import XlaCompiled
from tfhybrid.serving.exporter import export as serving_export

MODELS = ("dlrm", "dcnv2")


def _check_dims(name: str, dims: Any, allow_empty: bool = False) -> list[int]:
    dims = list(dims)
    if (not dims and not allow_empty) or any(
            isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"{name}={dims!r} must be a list of positive ints")
    return [int(d) for d in dims]


def _seed(seed: int, name: str) -> int:
    # every weight draws from its own seed, so the initial model is the same on every mesh
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31 - 1)


def mlp(dims: Sequence[int], name: str, last_linear: bool, seed: int) -> tf.keras.Sequential:
    """Dense layers of widths ``dims`` (ReLU; the last linear if ``last_linear``), each
    initialized from its own seed: the towers of DLRM and DCN-v2.

    >>> [layer.units for layer in mlp([8, 1], "top", last_linear=True, seed=0).layers]
    [8, 1]
    """
    layers = [tf.keras.layers.Dense(
        d, activation=None if last_linear and i == len(dims) - 1 else "relu",
        kernel_initializer=tf.keras.initializers.GlorotUniform(_seed(seed, f"{name}_{i}")),
        name=f"{name}_{i}") for i, d in enumerate(dims)]
    return tf.keras.Sequential(layers, name=name)


class _LocalTables(tf.keras.layers.Layer):
    """Whole tables in one process, called like DistributedEmbedding (a list of [b] ids)."""

    def __init__(self, tables: Sequence[tf.keras.layers.Embedding], **kwargs: Any):
        super().__init__(**kwargs)
        self.tables = list(tables)

    def call(self, ids):
        return [table(x) for table, x in zip(self.tables, ids)]

    def set_weights(self, weights):
        for table, w in zip(self.tables, weights):
            if getattr(table, "dims", None) == "adaptive":
                table.table.write_rows(0, w)   # FIITED: pruned entries stay pruned
            else:
                table.set_weights([w])


class DotInteraction(tf.keras.layers.Layer):
    """DLRM's interaction: the bottom MLP's output (the first vector) and the dot
    products of every pair of feature vectors.

    Example::

        >>> out = DotInteraction()([tf.ones([2, 4]), tf.ones([2, 4]), tf.ones([2, 4])])
        >>> out.shape   # 4 + the 3 pairs of 3 vectors
        TensorShape([2, 7])
    """

    def call(self, vectors):
        stacked = tf.stack(vectors, axis=1)                        # [b, f, d]
        f = len(vectors)
        dots = tf.reshape(tf.matmul(stacked, stacked, transpose_b=True), [-1, f * f])
        # the strictly lower triangle: each unordered pair once, no self products
        pairs = [i * f + j for i in range(f) for j in range(i)]
        return tf.concat([vectors[0], tf.gather(dots, pairs, axis=1)], axis=1)


class _ClickModel(tf.keras.Model):
    """Shared by both models: the config, the embeddings and the float32 logits."""

    def __init__(self, table_rows: Sequence[int], dense_features: int, embedding_dim: int,
                 top_mlp_dims: Sequence[int] = (1024, 1024, 512, 256, 1),
                 distributed: bool = True, xla: bool = False,
                 embedding_options: dict | None = None, seed: int = 0,
                 fiited: dict | None = None, dynamic_tables: dict | None = None,
                 embedding_layer: tf.keras.layers.Layer | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.table_rows = _check_dims("table_rows", table_rows)
        if isinstance(dense_features, bool) or not isinstance(dense_features, int) \
                or dense_features < 0:
            raise ValueError(f"dense_features={dense_features!r} must be an int >= 0")
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) \
                or embedding_dim < 1:
            raise ValueError(f"embedding_dim={embedding_dim!r} must be an int >= 1")
        top = _check_dims("top_mlp_dims", top_mlp_dims)
        if top[-1] != 1:
            raise ValueError(f"top_mlp_dims={top} must end in 1 (the logit)")
        self.top_mlp_dims = top
        self.dense_features = dense_features
        self.embedding_dim = embedding_dim
        self.distributed = bool(distributed)
        self.xla = bool(xla)
        self.embedding_options = dict(embedding_options or {})
        self.seed = int(seed)
        # FIITED: {"chunks": C, "target_memory": share} makes every table dims="adaptive"
        self.fiited = None if fiited is None else dict(fiited)
        # dynamic tables: {feature index: DynamicEmbedding options}; a config read back
        # from JSON has its keys as strings. A read-only view: Keras would track a dict
        # attribute, and a checkpoint cannot save a tracked dict with int keys.
        self.dynamic_tables = types.MappingProxyType(
            {int(t): dict(options) for t, options in (dynamic_tables or {}).items()})
        unknown = sorted(t for t in self.dynamic_tables
                         if not 0 <= t < len(self.table_rows))
        if unknown:
            raise ValueError(f"dynamic tables {unknown} are not features of this model "
                             f"(0 to {len(self.table_rows) - 1})")
        if self.dynamic_tables and self.fiited:
            raise ValueError("fiited and dynamic tables exclude each other: FIITED's widths "
                             "belong to rows of fixed ids")
        if self.dynamic_tables and not self.distributed:
            raise ValueError("dynamic tables need distributed=True (a one-process copy "
                             "holds whole tables by row)")
        # a served copy's tables (tfhybrid.serving's stand-in, see serving_twin): not in
        # the config, which describes the trained model
        if embedding_layer is not None:
            self.embedding = embedding_layer
        elif self.distributed:
            tables = [self._table(t, rows) for t, rows in enumerate(self.table_rows)]
            self.embedding = DistributedEmbedding(tables, name="embedding",
                                                  **self.embedding_options)
        else:
            tables = [self._table(t, rows) for t, rows in enumerate(self.table_rows)]
            self.embedding = _LocalTables(tables, name="embedding")
        self.top_mlp = self._compiled(mlp(self.top_mlp_dims, "top_mlp", last_linear=True,
                                           seed=self.seed))
        # under mixed precision the logits still leave in float32
        self.logits = tf.keras.layers.Activation("linear", dtype="float32", name="logits")

    def _table(self, t: int, rows: int) -> tf.keras.layers.Layer:
        """Feature t's table: dynamic, FIITED's adaptive one, or a Keras Embedding."""
        seed = _seed(self.seed, f"table_{t}")
        if t in self.dynamic_tables:
            # Keras' "uniform" [-0.05, 0.05) as the fixed tables, drawn from key and seed
            return DynamicEmbedding(self.embedding_dim, name=f"table_{t}",
                                    initializer="uniform", seed=seed,
                                    **self.dynamic_tables[t])
        return (Embedding if self.fiited else tf.keras.layers.Embedding)(
            rows, self.embedding_dim, name=f"table_{t}",
            embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05,
                                                                       seed=seed),
            **(dict(dims="adaptive", **self.fiited) if self.fiited else {}))

    def _compiled(self, layer: tf.keras.layers.Layer) -> tf.keras.layers.Layer:
        return XlaCompiled(layer, name=f"xla_{layer.name}") if self.xla else layer

    def _embed(self, inputs) -> list:
        categorical = inputs["categorical"]
        if categorical.shape.rank != 2 or categorical.shape[1] != len(self.table_rows):
            raise ValueError(f"inputs['categorical'] has shape {categorical.shape}; expected "
                             f"[batch, {len(self.table_rows)}]")
        return self.embedding(tf.unstack(categorical, axis=1))

    def get_config(self) -> dict:
        return {"table_rows": list(self.table_rows), "dense_features": self.dense_features,
                "embedding_dim": self.embedding_dim, "top_mlp_dims": list(self.top_mlp_dims),
                "distributed": self.distributed, "xla": self.xla,
                "embedding_options": dict(self.embedding_options), "seed": self.seed,
                "fiited": None if self.fiited is None else dict(self.fiited),
                "dynamic_tables": {t: dict(options)
                                   for t, options in self.dynamic_tables.items()},
                "name": self.name}

    @classmethod
    def from_config(cls, config: dict, custom_objects=None) -> "_ClickModel":
        return cls(**config)

    def serving_twin(self, replacements: dict) -> "_ClickModel":
        """A copy that calls ``replacements[self.embedding]`` (``tfhybrid.serving``'s
        stand-in of plain TF lookups) and shares nothing else: its dense layers hold
        this model's current weights (no XLA, the global precision policy)."""
        config = dict(self.get_config(), xla=False, embedding_options={}, fiited=None,
                      dynamic_tables={})
        copy = type(self)(embedding_layer=replacements[self.embedding], **config)
        copy(example_batch(copy))
        for target, source in zip(_dense_layers(copy), _dense_layers(self)):
            target.set_weights(source.get_weights())
        return copy

    def serving_signature(self) -> dict:
        """The inputs a served copy takes, as named specs: ``dense`` and ``categorical``."""
        return {"dense": tf.TensorSpec([None, self.dense_features], tf.float32, name="dense"),
                "categorical": tf.TensorSpec([None, len(self.table_rows)], tf.int32,
                                             name="categorical")}


class DLRM(_ClickModel):
    """DLRM: bottom MLP, (distributed) embeddings, dot interaction, top MLP.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.train.models import DLRM
        tfhybrid.init(model_parallel=1)
        model = DLRM(table_rows=[100, 20], dense_features=3, embedding_dim=4,
                     bottom_mlp_dims=[8, 4], top_mlp_dims=[8, 1])
        logits = model({"dense": tf.ones([2, 3]), "categorical": tf.constant([[1, 2], [3, 4]])})
        assert logits.shape == (2, 1)
    """

    def __init__(self, table_rows: Sequence[int], dense_features: int, embedding_dim: int,
                 bottom_mlp_dims: Sequence[int] = (512, 256, 128), **kwargs: Any):
        super().__init__(table_rows, dense_features, embedding_dim, **kwargs)
        bottom = _check_dims("bottom_mlp_dims", bottom_mlp_dims)
        if bottom[-1] != embedding_dim:
            raise ValueError(f"bottom_mlp_dims={bottom} must end in "
                             f"embedding_dim={embedding_dim}: the dot interaction multiplies "
                             "its output with the embeddings")
        self.bottom_mlp_dims = bottom
        self.bottom_mlp = self._compiled(mlp(self.bottom_mlp_dims, "bottom_mlp",
                                              last_linear=False, seed=self.seed))
        self.interaction = self._compiled(DotInteraction(name="interaction"))

    def call(self, inputs, training=None):
        embedded = self._embed(inputs)
        bottom = self.bottom_mlp(tf.cast(inputs["dense"], self.compute_dtype), training=training)
        interacted = self.interaction([bottom] + list(embedded))
        return self.logits(self.top_mlp(interacted, training=training))

    def get_config(self) -> dict:
        return dict(super().get_config(), bottom_mlp_dims=list(self.bottom_mlp_dims))


class Cross(tf.keras.layers.Layer):
    """One DCN-v2 cross layer, ``x0 * (W x + b) + x`` (``W = V U`` of rank
    ``projection_dim`` when given), as ``tfrs.layers.dcn.Cross`` computes it, with its
    sublayers' names (so checkpoints keep their keys); TF Recommenders itself imports
    only under Keras 2.

    Example::

        import tensorflow as tf
        from tfhybrid.train.models import Cross
        x0 = tf.ones([2, 3])
        assert Cross(projection_dim=None, seed=1)(x0, x0).shape == (2, 3)
    """

    def __init__(self, projection_dim: int | None, seed: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.projection_dim = projection_dim
        self.seed = seed

    def build(self, input_shape):
        width = int(input_shape[-1])
        # each Dense draws from the same seed, as tfrs clones its one initializer, and
        # computes in the variables' dtype (float32 under a mixed policy), as tfrs does
        initializer = lambda: tf.keras.initializers.GlorotUniform(self.seed)  # noqa: E731
        if self.projection_dim is None:
            self._dense = tf.keras.layers.Dense(width, kernel_initializer=initializer(),
                                                dtype=self.dtype)
        else:
            self._dense_u = tf.keras.layers.Dense(self.projection_dim, use_bias=False,
                                                  kernel_initializer=initializer(),
                                                  dtype=self.dtype)
            self._dense_v = tf.keras.layers.Dense(width, kernel_initializer=initializer(),
                                                  dtype=self.dtype)
        self.built = True

    def call(self, x0, x):
        product = (self._dense(x) if self.projection_dim is None
                   else self._dense_v(self._dense_u(x)))
        return x0 * tf.cast(product, self.compute_dtype) + x


class _CrossNetwork(tf.keras.layers.Layer):
    def __init__(self, num_layers: int, projection_dim: int | None, seed: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.cross = [Cross(projection_dim, _seed(seed, f"cross_{i}"), name=f"cross_{i}")
                      for i in range(num_layers)]

    def call(self, x0):
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return x


class DCNv2(_ClickModel):
    """DCN-v2: dense features and embeddings concatenated, cross layers, deep tower.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.train.models import DCNv2
        tfhybrid.init(model_parallel=1)
        model = DCNv2(table_rows=[100, 20], dense_features=3, embedding_dim=4,
                      num_cross_layers=2, top_mlp_dims=[8, 1])
        logits = model({"dense": tf.ones([2, 3]), "categorical": tf.constant([[1, 2], [3, 4]])})
        assert logits.shape == (2, 1)
    """

    def __init__(self, table_rows: Sequence[int], dense_features: int, embedding_dim: int,
                 num_cross_layers: int = 3, projection_dim: int | None = None,
                 **kwargs: Any):
        super().__init__(table_rows, dense_features, embedding_dim, **kwargs)
        if isinstance(num_cross_layers, bool) or not isinstance(num_cross_layers, int) \
                or num_cross_layers < 1:
            raise ValueError(f"num_cross_layers={num_cross_layers!r} must be an int >= 1")
        if projection_dim is not None and (not isinstance(projection_dim, int)
                                           or projection_dim < 1):
            raise ValueError(f"projection_dim={projection_dim!r} must be None or an int >= 1")
        self.num_cross_layers = num_cross_layers
        self.projection_dim = projection_dim
        self.cross_network = self._compiled(_CrossNetwork(num_cross_layers, projection_dim,
                                                          self.seed, name="cross_network"))

    def call(self, inputs, training=None):
        embedded = self._embed(inputs)
        x0 = tf.concat([tf.cast(inputs["dense"], self.compute_dtype)] + list(embedded), axis=1)
        return self.logits(self.top_mlp(self.cross_network(x0), training=training))

    def get_config(self) -> dict:
        return dict(super().get_config(), num_cross_layers=self.num_cross_layers,
                    projection_dim=self.projection_dim)


def build_model(model: str, table_rows: Sequence[int], dense_features: int, **kwargs: Any
                ) -> _ClickModel:
    """``DLRM`` or ``DCNv2`` by name (``"dlrm"`` / ``"dcnv2"``); ``kwargs`` go to its class."""
    if model == "dlrm":
        return DLRM(table_rows, dense_features, **kwargs)
    if model == "dcnv2":
        return DCNv2(table_rows, dense_features, **kwargs)
    raise ValueError(f"model={model!r} is unknown; expected one of {MODELS}")


def example_batch(model: _ClickModel, batch: int = 1) -> dict:
    """A batch of zeros of the model's input structure (builds a model by calling it)."""
    return {"dense": tf.zeros([batch, model.dense_features], tf.float32),
            "categorical": tf.zeros([batch, len(model.table_rows)],
                                    tf.int64 if model.dynamic_tables else tf.int32)}


def _dense_layers(model: _ClickModel) -> list:
    return [layer for layer in model.layers if layer is not model.embedding]


def serving_copy(model: _ClickModel, tables: Sequence[np.ndarray]) -> _ClickModel:
    """A one-process float32 copy of ``model`` with whole tables (no Horovod, no XLA).

    ``tables`` are the full tables, e.g. ``model.embedding.get_weights()`` on rank 0.
    """
    policy = tf.keras.mixed_precision.global_policy()
    tf.keras.mixed_precision.set_global_policy("float32")
    try:
        # FIITED's tables are served dense: their pruned entries are zeros
        config = dict(model.get_config(), distributed=False, xla=False, embedding_options={},
                      fiited=None)
        copy = type(model).from_config(config)
        copy(example_batch(copy))
    finally:
        tf.keras.mixed_precision.set_global_policy(policy)
    copy.embedding.set_weights(tables)
    for target, source in zip(_dense_layers(copy), _dense_layers(model)):
        target.set_weights(source.get_weights())
    return copy


def serving_outputs(logits: tf.Tensor) -> dict:
    """The served signatures' outputs: the click probability and the logits."""
    logits = tf.cast(logits, tf.float32)
    return {"probability": tf.sigmoid(logits), "logits": logits}


def export_for_serving(model: _ClickModel, export_dir: str, rank: int = 0,
                       store: Any = None, tables: str = "inline",
                       precision: str = "float32") -> str | None:
    """Writes a single-process SavedModel of ``model`` to ``export_dir`` (rank 0 only),
    through ``tfhybrid.serving.export``.

    Every rank must call it (the full tables are gathered). The SavedModel's
    ``serving_default`` signature takes ``dense`` and ``categorical`` and returns the
    click probability; it loads with plain TensorFlow (``tf.saved_model.load``). With
    ``tables="external"`` and a ``tfhybrid.serving.RedisStore``, the tables are also
    written into the store by the ranks that hold them, in ``precision``, for
    ``tfhybrid.serving.Predictor``. ``rank`` is unused (the mesh's rank decides).
    """
    if not model.distributed:
        raise ValueError("export_for_serving takes a distributed model (a copy with whole "
                         "tables, distributed=False, is what it writes)")
    return serving_export(model, export_dir, store=store, tables=tables, precision=precision,
                  input_signature=model.serving_signature(), outputs=serving_outputs,
                  versioned=False)


__all__ = ["DLRM", "DCNv2", "DotInteraction", "MODELS", "build_model", "export_for_serving",
           "mlp", "serving_outputs"]
