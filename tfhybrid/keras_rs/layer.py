"""``tfhybrid.keras_rs.DistributedEmbedding``: keras-rs's layer, its tables on the mesh.

keras-rs 0.4.0's ``keras_rs.layers.DistributedEmbedding`` distributes only on TPUs with
SparseCore; on CPUs and GPUs it is one ``EmbedReduce`` layer per table on one device.
This layer takes the same arguments (feature configs in any nesting of dicts, lists and
tuples, ``table_stacking``, ``update_stats``, keras-rs's TensorFlow-only keywords), the
same inputs and weights, and returns the same nested structure; inside, one
``tfhybrid.layers.DistributedEmbedding`` of ``tfhybrid.layers.Embedding`` tables (one per
``TableConfig`` object, shared by the features that name it) plans and shards them over
the D x M mesh like any other.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfhybrid import mesh as mesh_lib
from tfhybrid.keras_rs import configs
from tfhybrid.keras_rs import table_optimizer
from tfhybrid.layers.distributed_embedding import DistributedEmbedding as ShardedEmbedding
from tfhybrid.layers.embedding import Embedding

__all__ = ["DistributedEmbedding", "TABLE_OPTIMIZERS", "TPU_ONLY_ARGUMENTS"]

_LOG = logging.getLogger(__name__)

# How tables are trained: "model", by the model's optimizer (what keras-rs does on CPUs
# and GPUs, whatever TableConfig.optimizer says); "honour", each by the optimizer its
# TableConfig names (``layer.table_optimizer``, the DistributedOptimizer's
# embedding_optimizer), as keras-rs on TPUs
TABLE_OPTIMIZERS = ("model", "honour")
# keras-rs's keywords that only its TPU (SparseCore) path reads
TPU_ONLY_ARGUMENTS = ("optimizer", "pipeline_execution_with_tensor_core",
                      "sparse_core_embedding_config")
# tfhybrid.layers.DistributedEmbedding's arguments this layer sets itself: the tables and
# which feature reads which come from the feature configs, the mesh is an argument of
# its own, and every rank feeds its own batch of every feature (keras-rs's inputs)
_SET_HERE = ("embeddings", "input_table_map", "mesh", "dp_input")
def _check_table_stacking(table_stacking: Any, names: Sequence[str]) -> None:
    """keras-rs's forms: ``"auto"``, None, a list of table names or a list of such lists;
    ``ValueError`` names a value of another form or a name that is no table."""
    if table_stacking in ("auto", None):
        return
    groups = table_stacking
    if isinstance(groups, (list, tuple)) and groups and all(isinstance(g, str) for g in groups):
        groups = [groups]
    if not (isinstance(groups, (list, tuple)) and all(
            isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g)
            for g in groups)):
        raise ValueError(f"table_stacking={table_stacking!r} must be 'auto', None, a list "
                         "of table names or a list of lists of table names")
    unknown = sorted({n for g in groups for n in g} - set(names))
    if unknown:
        raise ValueError(f"table_stacking={table_stacking!r} names {unknown}, which are not "
                         f"tables; the tables are {sorted(names)}")


# registered, so a saved model (.keras) holding it loads without custom_objects
@tf.keras.utils.register_keras_serializable(package="tfhybrid.keras_rs")
class DistributedEmbedding(tf.keras.layers.Layer):
    """keras-rs's ``DistributedEmbedding`` on the D x M mesh: change one import.

    Args:
      feature_configs: a nested structure (dicts, lists, tuples) of
        ``keras_rs.layers.FeatureConfig`` (or :class:`tfhybrid.keras_rs.FeatureConfig`);
        features that name the same ``TableConfig`` object share its table. Each table's
        ``vocabulary_size``, ``embedding_dim``, ``combiner`` (``"mean"``, ``"sum"``,
        ``"sqrtn"``) and ``initializer`` are honoured: the initializer draws the whole
        ``[vocabulary_size, embedding_dim]`` table, as keras-rs draws it, and every rank
        keeps its shards' slice of it, so a seeded initializer starts the same table on
        every mesh (each rank that holds a shard draws the whole table once, when the
        layer builds). ``placement`` is checked and not used (every table is planned
        over the mesh); ``optimizer``: see ``table_optimizers``.
      table_stacking: keras-rs's argument, checked (table names) and not used: the
        planner places each table.
      update_stats: keras-rs's JAX-only argument; ``True`` raises ``ValueError``, as
        keras-rs's TensorFlow layer does.
      mesh: a ``tfhybrid.Mesh``; ``None`` takes ``tfhybrid.init()``'s.
      sharding: keyword arguments of ``tfhybrid.layers.DistributedEmbedding`` (the
        planner's ``strategy`` and thresholds, ``replica_sync``, ``plan``, ``dct``,
        ``use_custom_kernel``, ``memory_budget``, ...), but the tables, their map, the
        mesh and ``dp_input``, which this layer sets.
      table_optimizers: ``"model"`` (default): every table is trained by the model's
        optimizer, as keras-rs trains them on CPUs and GPUs; a warning says once that
        ``TableConfig.optimizer`` is not used. ``"honour"``: each table's own
        optimizer, as keras-rs on TPUs: one of SGD, Adagrad, Adam and FTRL
        (``ValueError`` names the others), tables may name different ones, and
        :attr:`table_optimizer` trains them, to pass as
        ``tfhybrid.DistributedOptimizer(..., embedding_optimizer=...)``.
      **kwargs: Keras layer arguments; keras-rs's TPU-only ``optimizer``,
        ``pipeline_execution_with_tensor_core`` and ``sparse_core_embedding_config`` are
        accepted and not used (logged once).

    ``call(inputs, weights=None, training=None)``: ``inputs`` in the nesting of
    ``feature_configs``, each ids ``[batch]``, ``[batch, hotness]``, a
    ``tf.RaggedTensor`` ``[batch, None]`` or a ``tf.SparseTensor`` ``[batch, n]``;
    ``weights`` (optional) in the same nesting, each of its ids' shape and kind, or
    None. Returns ``[batch, embedding_dim]`` per feature in the same nesting: ``[batch]``
    ids are looked up without a combiner (with ``"sum"`` scaled by their weight), the
    others combined. Each rank feeds its own local batch; the first dimension of a
    feature's ``input_shape`` (keras-rs's global batch) is not checked.

    One process here; under horovodrun the same code shards over the mesh.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid import keras_rs
        tfhybrid.init(model_parallel=1)
        table = keras_rs.TableConfig(
            name="item", vocabulary_size=100, embedding_dim=4, combiner="sum",
            initializer=tf.keras.initializers.RandomUniform(seed=1))
        layer = keras_rs.DistributedEmbedding({
            "seen": keras_rs.FeatureConfig("seen", table, (2, 3), (2, 4)),
            "next": keras_rs.FeatureConfig("next", table, (2,), (2, 4))})
        out = layer({"seen": tf.constant([[1, 2, 3], [4, 5, 6]]),
                     "next": tf.constant([7, 8])})
        assert out["seen"].shape == (2, 4) and out["next"].shape == (2, 4)
    """

    def __init__(self, feature_configs: Any, *, table_stacking: Any = "auto",
                 update_stats: bool = False, mesh: mesh_lib.Mesh | None = None,
                 sharding: dict | None = None, table_optimizers: str = "model",
                 **kwargs: Any):
        ignored = {k: kwargs.pop(k) for k in TPU_ONLY_ARGUMENTS if k in kwargs}
        super().__init__(**kwargs)
        if update_stats:
            # keras-rs's TensorFlow layer's own message
            raise ValueError("`update_stats` cannot be True for the TensorFlow backend.")
        if table_optimizers not in TABLE_OPTIMIZERS:
            raise ValueError(f"table_optimizers={table_optimizers!r} is unknown; expected "
                             f"one of {TABLE_OPTIMIZERS}")
        sharding = dict(sharding or {})
        fixed = sorted(set(sharding) & set(_SET_HERE))
        if fixed:
            raise ValueError(f"sharding sets {fixed}, which this layer sets itself (the "
                             "tables and their map from feature_configs, mesh= as its own "
                             "argument, every rank feeding its own batch)")
        features, tables = configs.read_features(feature_configs)
        _check_table_stacking(table_stacking, [t.name for t in tables])
        # ValueError naming an optimizer that is not honoured
        object.__setattr__(self, "_optimizer_specs", table_optimizer.table_optimizer_specs(
            tables) if table_optimizers == "honour" else None)
        object.__setattr__(self, "_table_optimizer", None)
        # plain data, set past Keras' __setattr__ (whose tracking would wrap the nesting)
        object.__setattr__(self, "_feature_configs", feature_configs)
        object.__setattr__(self, "_features", features)
        object.__setattr__(self, "_table_configs", tables)
        self.table_stacking = table_stacking
        self.update_stats = update_stats
        self.table_optimizers = table_optimizers
        self.sharding = sharding
        planned = dict(sharding)
        if self._optimizer_specs is not None:
            # the planner counts the honoured optimizers' state
            planned.setdefault("optimizer", table_optimizer.planned_as(self._optimizer_specs))
        self._tables = ShardedEmbedding(
            [Embedding(t.vocabulary_size, t.embedding_dim, name=t.name,
                       combiner=t.combiner,
                       # the tables' values are drawn whole at build (_initialize)
                       embeddings_initializer="zeros") for t in tables],
            mesh=mesh, input_table_map=[f.table for f in features],
            name=f"{self.name}_tables", **planned)
        self._log_what_is_not_used(ignored, tables)

    def _log_what_is_not_used(self, ignored: dict, tables: Sequence[Any]) -> None:
        """Once, when the layer is made: what keras-rs's arguments ask for that this
        layer does not do."""
        if ignored:
            _LOG.info("DistributedEmbedding %r: keras-rs's TPU-only arguments %s are not "
                      "used", self.name, sorted(ignored))
        placed = sorted({t.placement for t in tables} - {"auto"})
        if placed:
            _LOG.info("DistributedEmbedding %r: placement %s is not used; every table is "
                      "planned over the mesh", self.name, placed)
        with_optimizer = [t.name for t in tables if t.optimizer is not None]
        if with_optimizer and self._optimizer_specs is None:
            _LOG.warning("DistributedEmbedding %r: TableConfig.optimizer of tables %s is "
                         "not used; the model's optimizer trains every table, as keras-rs "
                         "does on CPUs and GPUs", self.name, with_optimizer)

    # ------------------------------------------------------------- properties
    @property
    def feature_configs(self) -> Any:
        """The nested feature configs, as given."""
        return self._feature_configs

    @property
    def sharded(self) -> ShardedEmbedding:
        """The ``tfhybrid.layers.DistributedEmbedding`` that holds the tables (its
        ``plan``, ``get_weights``, ``stores``, ...)."""
        return self._tables

    @property
    def table_optimizer(self) -> Any:
        """With ``table_optimizers="honour"``: what trains the tables (made once), for
        ``tfhybrid.DistributedOptimizer(dense_optimizer,
        embedding_optimizer=layer.table_optimizer)``: the Keras optimizer every table
        names where they name the same (class and configuration), else a
        ``tfhybrid.table_optimizers.TableOptimizers`` of each table's, by table name."""
        if self._optimizer_specs is None:
            raise ValueError(f"DistributedEmbedding {self.name!r}: table_optimizer needs "
                             f"table_optimizers='honour'; got {self.table_optimizers!r} "
                             "(the model's optimizer trains the tables)")
        if self._table_optimizer is None:
            # plain state, set past Keras' __setattr__: the optimizer's variables are the
            # DistributedOptimizer's to track, not this layer's
            object.__setattr__(self, "_table_optimizer",
                               table_optimizer.make_table_optimizer(self._optimizer_specs))
        return self._table_optimizer

    @property
    def plan(self) -> Any:
        """The tables' sharding plan (None before the layer builds)."""
        return self._tables.plan

    # ------------------------------------------------------------------ build
    def build(self, input_shape: Any) -> None:
        shapes = configs.flatten_like(self._feature_configs, input_shape, "input shapes")
        shapes = [tf.TensorShape(s) for s in shapes]
        for feature, shape in zip(self._features, shapes):
            if shape.rank not in (1, 2):
                raise ValueError(f"feature {feature.path or feature.config.name!r}: ids of "
                                 f"shape {shape} must be [batch] or [batch, ids]; inputs "
                                 "of rank 3 and higher are not allowed, as in keras-rs")
        self._tables.build(shapes)
        self._initialize()
        super().build(input_shape)

    def _initialize(self) -> None:
        """Each table drawn whole by its initializer (keras-rs's values), the shards this
        rank holds set to their slices. Eager even when the first call is traced."""
        sharded = self._tables
        values = []
        for t, table in enumerate(self._table_configs):
            placement = sharded.plan.tables[t]
            held = any(sharded.stores.get(t, s) is not None
                       for s in range(len(placement.shards)))
            values.append(self._whole_table(table) if held else None)
        with tf.init_scope():
            sharded.set_weights(values)

    @staticmethod
    def _whole_table(table: Any) -> np.ndarray:
        initializer = table.initializer
        if isinstance(initializer, (str, dict)):
            initializer = tf.keras.initializers.get(initializer)
        with tf.init_scope(), tf.device("/CPU:0"):
            value = initializer(shape=(table.vocabulary_size, table.embedding_dim),
                                dtype="float32")
            return np.asarray(value, np.float32)

    # ------------------------------------------------------------------- call
    def call(self, inputs: Any, weights: Any = None, training: Any = None) -> Any:
        ids = configs.flatten_like(self._feature_configs, inputs, "inputs")
        given = (configs.flatten_like(self._feature_configs, weights, "weights")
                 if weights is not None else [None] * len(ids))
        feeds, bag_weights = [], []
        for feature, x, w in zip(self._features, ids, given):
            x, w = self._feed(feature, x, w)
            feeds.append(x)
            bag_weights.append(w)
        if any(w is not None for w in bag_weights):
            outputs = self._tables(feeds, weights=bag_weights, training=training)
        else:
            outputs = self._tables(feeds, training=training)
        return configs.pack_like(self._feature_configs, list(outputs))

    def _feed(self, feature: configs.Feature, ids: Any, weights: Any) -> tuple:
        """A feature's ids and weights as the sharded layer takes them: a SparseTensor's
        rows as a RaggedTensor's (its columns do not matter to a combiner), weights
        checked against the ids and dropped where keras-rs drops them."""
        name = feature.path or feature.config.name
        if isinstance(ids, tf.SparseTensor):
            if weights is not None:
                if not isinstance(weights, tf.SparseTensor):
                    raise ValueError(f"feature {name!r}: weights must be a tf.SparseTensor "
                                     f"as its ids are; got {type(weights).__name__}")
                # keras-rs's rule: a weight at each id's own position
                with tf.control_dependencies([tf.debugging.assert_equal(
                        weights.indices, ids.indices,
                        message=f"feature {name!r}: the weights' indices must be the ids'")]):
                    weights = _sparse_to_ragged(weights, name, "weights")
            ids = _sparse_to_ragged(ids, name, "ids")
        if not isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
            ids = tf.convert_to_tensor(ids)
        if ids.shape.rank not in (1, 2):
            raise ValueError(f"feature {name!r}: ids of shape {ids.shape} must be [batch] "
                             "or [batch, ids]; inputs of rank 3 and higher are not allowed, "
                             "as in keras-rs")
        if weights is None:
            return ids, None
        if isinstance(ids, tf.RaggedTensor) != isinstance(weights, tf.RaggedTensor):
            raise ValueError(f"feature {name!r}: weights must be of its ids' kind "
                             f"({type(ids).__name__}); got {type(weights).__name__}")
        if not isinstance(weights, tf.RaggedTensor):
            weights = tf.convert_to_tensor(weights)
        if not weights.shape.is_compatible_with(ids.shape):
            raise ValueError(f"feature {name!r}: weights of shape {weights.shape} do not "
                             f"match its ids' shape {ids.shape}")
        if ids.shape.rank == 1 and feature.config.table.combiner != "sum":
            # one id per sample is not combined: keras-rs scales it by its weight for
            # "sum" only (a mean or sqrtn of one weighted row is the row)
            return ids, None
        if isinstance(weights, tf.RaggedTensor):
            weights = weights.with_flat_values(tf.cast(weights.flat_values, tf.float32))
        else:
            weights = tf.cast(weights, tf.float32)
        return ids, weights

    def compute_output_shape(self, input_shape: Any) -> Any:
        shapes = configs.flatten_like(self._feature_configs, input_shape, "input shapes")
        return configs.pack_like(self._feature_configs, [
            tf.TensorShape([tf.TensorShape(s)[0], f.config.table.embedding_dim])
            for f, s in zip(self._features, shapes)])

    # ------------------------------------------------------------ full tables
    def get_embedding_tables(self) -> dict[str, np.ndarray]:
        """Every table whole, by its ``TableConfig`` name (keras-rs's method). A
        collective: every rank must call it, and every rank gets the tables."""
        # (get_weights ends with every rank leaving together)
        whole = self._tables.get_weights(all_ranks=True)
        return {t.name: value for t, value in zip(self._table_configs, whole)}

    # ----------------------------------------------------------------- config
    def get_config(self) -> dict:
        config = super().get_config()
        nested, tables = configs.serialize_features(self._feature_configs, self._features,
                                                    self._table_configs)
        inner = self._tables.get_config()
        config.update(feature_configs=nested, tables=tables,
                      table_stacking=self.table_stacking, update_stats=self.update_stats,
                      table_optimizers=self.table_optimizers,
                      # the serializable form of each sharding argument (a plan's JSON,
                      # a DCT's config)
                      sharding={k: inner[k] for k in self.sharding})
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DistributedEmbedding":
        config = dict(config)
        feature_class, table_class = _config_classes()
        config["feature_configs"] = configs.deserialize_features(
            config["feature_configs"], config.pop("tables"), feature_class, table_class)
        return cls(**config)


def _config_classes() -> tuple:
    """keras-rs's config classes where it is installed (a model saved with keras-rs's
    objects loads with them), else the stand-ins."""
    try:
        import keras_rs
    except ImportError:
        return configs.FeatureConfig, configs.TableConfig
    return keras_rs.layers.FeatureConfig, keras_rs.layers.TableConfig


def _sparse_to_ragged(value: tf.SparseTensor, name: str, what: str) -> tf.RaggedTensor:
    """A ``[batch, n]`` SparseTensor's rows, in order, as a RaggedTensor's."""
    if value.shape.rank != 2:
        raise ValueError(f"feature {name!r}: a tf.SparseTensor of {what} must be "
                         f"[batch, n]; got shape {value.shape}")
    value = tf.sparse.reorder(value)
    return tf.RaggedTensor.from_value_rowids(value.values, value.indices[:, 0],
                                             nrows=value.dense_shape[0])
