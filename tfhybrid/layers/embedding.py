"""A Keras Embedding with a combiner: the single-table layer tfhybrid shards.

This module is also a drop-in for NVIDIA Merlin distributed-embeddings'
``distributed_embeddings.python.layers.embedding``: it offers the same names
(``Embedding``, ``CPUInitializer``, ``ConcatOneHotEmbedding`` / ``ConcatEmbedding``,
``IntegerLookup``), so code written against that module runs with only its import changed.
"""

from __future__ import annotations

import logging
from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import custom_ops
from tfhybrid.combiners import kept_in_bags
from tfhybrid.fiited import ChunkedTable
from tfhybrid.plan.types import COMBINERS
from tfhybrid.tiers import POLICIES, CachedTable, ChunkedCachedTable
# Re-exported so that `tfhybrid.layers.embedding.X` resolves every X that
# distributed-embeddings' embedding module has; each lives in its own module.
from tfhybrid.layers.concat_one_hot import ConcatEmbedding, ConcatOneHotEmbedding  # noqa: F401
from tfhybrid.layers.integer_lookup import IntegerLookup  # noqa: F401

__all__ = ["Embedding", "CPUInitializer", "ConcatOneHotEmbedding", "ConcatEmbedding",
           "IntegerLookup", "COMBINERS"]

_LOG = logging.getLogger(__name__)

DIMS = (None, "adaptive")


class CPUInitializer(tf.keras.initializers.Initializer):
    """Wraps an initializer so the initial table is drawn on the CPU.

    A table larger than an accelerator's memory can still be created there and then
    sharded; the values are exactly those of the wrapped initializer.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import CPUInitializer
        init = CPUInitializer(tf.keras.initializers.Constant(0.5))
        assert float(init((2, 3))[1, 2]) == 0.5
    """

    def __init__(self, initializer: Any):
        self._initializer = tf.keras.initializers.get(initializer)

    def __call__(self, shape, dtype=None, **kwargs) -> tf.Tensor:
        with tf.device("/CPU:0"):
            if dtype is not None:
                kwargs["dtype"] = dtype
            return self._initializer(shape, **kwargs)

    def get_config(self) -> dict:
        return {"initializer": tf.keras.initializers.serialize(self._initializer)}

    @classmethod
    def from_config(cls, config: dict) -> "CPUInitializer":
        return cls(tf.keras.initializers.deserialize(config["initializer"]))


class Embedding(tf.keras.layers.Embedding):
    """``tf.keras.layers.Embedding`` plus an optional combiner over each sample's ids.

    With ``combiner=None`` it gives what the Keras layer gives: dense ids of any shape
    ``S`` give ``S + [output_dim]``, a ``tf.RaggedTensor`` gives a ragged result with one
    more (uniform) dimension, and float ids are cast to int32 first.

    With ``combiner="sum"`` or ``"mean"`` the embeddings of the last id dimension are
    reduced (as distributed-embeddings' ``Embedding`` does):

    - dense ``[d1, ..., dn]`` (n >= 2) gives ``[d1, ..., d(n-1), output_dim]``;
    - ``tf.RaggedTensor`` or ``tf.SparseTensor`` ``[batch, None]`` gives
      ``[batch, output_dim]`` (a sparse row's ids are combined whatever their columns);
    - an empty bag gives zeros (``"mean"`` divides by ``max(bag size, 1)``);
    - dense ``[batch]`` ids are taken as one id per sample, giving ``[batch, output_dim]``
      (distributed-embeddings raises ValueError here; an INFO line says so once).

    ``use_custom_kernel=True`` (the default) runs tfhybrid's fused lookup+combine C++ op
    (``tfhybrid.custom_ops.embedding_lookup_combine``) where it is built and the table is
    on the CPU, else plain TF ops; ``False`` always uses plain TF ops. Both give the same
    values.

    ``dims="adaptive"`` stores the table as FIITED's chunked pool
    (:class:`tfhybrid.fiited.ChunkedTable`: ``chunks`` chunks per row, rows keep a prefix,
    pruned chunks read as zeros and take no memory). Until the first adjustment it equals
    the dense table; :meth:`adjust` (or the :class:`tfhybrid.callbacks.FiitedAdjust`
    callback, every N steps in ``fit``) re-divides ``target_memory`` of the chunks by each
    row's utility. Train it with :class:`tfhybrid.optimizers.RowWiseAdagrad` (its state is
    one accumulator per logical row, kept by the table): Keras' optimizers keep state shaped
    like the pool, which changes size. Inside a ``DistributedEmbedding`` each shard is a
    pool, and every mesh prunes as one process does.

    ``cache_rows=N`` (with ``store_dir``) keeps the table in a slower tier, a
    memory-mapped file in ``store_dir``, with an ``N``-row DRAM cache in front
    (:class:`tfhybrid.tiers.CachedTable`, ``cache_policy="lru"`` or ``"lfu"``): before each
    lookup the batch's rows are loaded into the cache and evicted rows written back, so a
    table larger than memory trains exactly as it would in memory (SGD without momentum,
    or ``RowWiseAdagrad``, whose per-row state moves with the rows). One batch may name at
    most ``N`` distinct ids. In a ``DistributedEmbedding`` each shard keeps the same share
    of its rows cached. With ``dims="adaptive"`` too, the tier's rows keep FIITED's
    per-row widths (:class:`tfhybrid.tiers.ChunkedCachedTable`) and train exactly as the
    adaptive table in memory.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import Embedding
        layer = Embedding(100, 8, combiner="mean")
        out = layer(tf.ragged.constant([[1, 2, 3], [4]]))
        assert out.shape == (2, 8)
        ids = tf.constant([[[1, 2], [3, 4], [5, 6]]])   # [1, 3, 2] -> [1, 3, 8]
        assert layer(ids).shape == (1, 3, 8)
    """

    def __init__(self, input_dim: int, output_dim: int, combiner: str | None = None,
                 use_custom_kernel: bool = True, dims: str | None = None, chunks: int = 8,
                 target_memory: float = 0.35, cache_rows: int | None = None,
                 store_dir: str | None = None, cache_policy: str = "lru", **kwargs: Any):
        _tf_internals.install_autograph_rule()
        if combiner not in COMBINERS:
            hint = (" (distributed-embeddings' 'indices_weight' is not supported)"
                    if combiner == "indices_weight" else "")
            raise ValueError(
                f"combiner={combiner!r} is unknown; expected one of {COMBINERS}{hint}")
        if not isinstance(use_custom_kernel, bool):
            raise ValueError(f"use_custom_kernel={use_custom_kernel!r}; expected True or False")
        if combiner is not None and kwargs.get("mask_zero"):
            # A combined output has no id axis left to carry the mask.
            raise ValueError(f"mask_zero=True needs combiner=None; got combiner={combiner!r}")
        if combiner is not None and kwargs.get("sparse"):
            raise ValueError(f"sparse=True (a SparseTensor output) needs combiner=None; got "
                             f"combiner={combiner!r}")
        if dims not in DIMS:
            raise ValueError(f"dims={dims!r} is unknown; expected one of {DIMS}")
        if dims == "adaptive":
            unsupported = [k for k in ("sparse", "embeddings_regularizer",
                                       "embeddings_constraint", "activity_regularizer")
                           if kwargs.get(k)]
            if unsupported:
                raise ValueError(f"dims='adaptive' does not support {unsupported}: got "
                                 f"{ {k: kwargs[k] for k in unsupported} }")
            # the table checks chunks and output_dim; target_memory is checked here so
            # that a bad value fails at construction, not at the first adjustment
            ChunkedTable.check_target(target_memory)
            if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or (
                    isinstance(output_dim, int) and output_dim % chunks):
                raise ValueError(f"chunks={chunks!r} must be an int >= 1 that divides "
                                 f"output_dim={output_dim!r}")
        if cache_rows is not None:
            _check_tier(cache_rows, store_dir, cache_policy, kwargs)
        super().__init__(input_dim, output_dim, **kwargs)
        self.cache_rows = cache_rows
        self.store_dir = store_dir
        self.cache_policy = cache_policy
        self.combiner = combiner
        self.use_custom_kernel = use_custom_kernel
        self.dims = dims
        self.chunks = chunks
        self.target_memory = float(target_memory)
        self._logged_1d = False

    # -------------------------------------------------------------------- build
    def build(self, input_shape=None):
        if self.cache_rows is not None:
            tier = dict(policy=self.cache_policy, name=self.name,
                        initializer=_block_initializer(self.embeddings_initializer,
                                                       self.output_dim),
                        add_weight=self.add_weight)
            if self.dims == "adaptive":
                self.table = ChunkedCachedTable(
                    self.input_dim, self.output_dim, self.cache_rows, self.store_dir,
                    chunks=self.chunks, use_custom_op=self._lookup_option(), **tier)
            else:
                self.table = CachedTable(self.input_dim, self.output_dim, self.cache_rows,
                                         self.store_dir, **tier)
            self.built = True
            return None
        if self.dims != "adaptive":
            return super().build(input_shape)
        with tf.init_scope():
            initial = self.embeddings_initializer(shape=(self.input_dim, self.output_dim),
                                                  dtype=tf.float32)
        self.table = ChunkedTable(self.input_dim, self.output_dim, self.chunks,
                                  initial_value=initial, use_custom_op=self._lookup_option(),
                                  name="table", add_weight=self.add_weight)
        self.built = True

    def get_weights(self) -> list:
        """The table, ``[input_dim, output_dim]``; for a table with ``cache_rows``, the
        whole table in row order (cached rows from the cache), not the cache."""
        if self.cache_rows is not None and self.built:
            return [self.table.read_rows(0, self.input_dim)]
        return super().get_weights()

    def set_weights(self, weights) -> None:
        """Sets the table; a table with ``cache_rows`` takes the whole table and keeps its
        row-wise optimizer state, as Keras keeps an optimizer's slots."""
        if self.cache_rows is not None and self.built:
            if len(weights) != 1:
                raise ValueError(f"Embedding {self.name!r}.set_weights takes one table; got "
                                 f"{len(weights)} arrays")
            self.table.write_rows(0, weights[0])
            return None
        if not self.built:
            # The table's shape does not depend on the ids: Keras 2 builds the layer when
            # a Sequential model takes it (its input_shape defaults to (None,)), Keras 3
            # at the first call, so `Sequential([layer]); layer.set_weights(...)` works in
            # both only if the layer builds here
            self.build()
        return super().set_weights(weights)

    def save_own_variables(self, store) -> None:
        """A Keras weights file's entry for the layer: an adaptive or tiered table writes
        its own state (a tiered one its rows in row order, not the cache)."""
        if self.built and (self.cache_rows is not None or self.dims == "adaptive"):
            return self.table.save_own_variables(store)
        return super().save_own_variables(store)

    def load_own_variables(self, store) -> None:
        """Reads what :meth:`save_own_variables` wrote."""
        if self.built and (self.cache_rows is not None or self.dims == "adaptive"):
            return self.table.load_own_variables(store)
        return super().load_own_variables(store)

    def adjust(self, target_memory: float | None = None) -> dict:
        """FIITED's adjustment (``dims="adaptive"`` only): keep ``target_memory`` (default:
        the layer's) of the table's chunks, divided by row utility."""
        if self.dims != "adaptive":
            raise ValueError(f"Embedding {self.name!r}: adjust() needs dims='adaptive', "
                             f"got dims={self.dims!r}")
        return self.table.adjust(self.target_memory if target_memory is None
                                 else target_memory)

    @property
    def has_adaptive_tables(self) -> bool:
        """Whether :meth:`adjust` applies (the FiitedAdjust callback asks): an adaptive
        table that is built (inside a DistributedEmbedding a layer is never built)."""
        return self.dims == "adaptive" and self.built

    def adjust_ramp(self, ramp: float) -> dict:
        """:meth:`adjust` with the budget ``ramp`` (0 to 1) of the way from the whole
        table to ``target_memory`` (``FiitedAdjust``'s schedule)."""
        return self.adjust(1.0 - (1.0 - self.target_memory) * ramp)

    # -------------------------------------------------------------------- call
    def call(self, inputs, weights=None):
        """``inputs``: ids (dense, ragged or sparse); ``weights``: None, or per-id float
        weights of the ids' form and shape (``tfhybrid.combiners``: with ``mean`` and
        ``sqrtn`` ids of weight <= 0 are dropped, as ``tf.nn.safe_embedding_lookup_sparse``
        drops them)."""
        ids = inputs
        if weights is not None:
            return tf.cast(self._lookup_weighted(_int_ids(ids), weights), self.compute_dtype)
        if self.dims == "adaptive" and self.combiner is None and (
                isinstance(ids, tf.SparseTensor)
                or _tf_internals.uses_one_hot_matmul(self)):
            raise ValueError(f"Embedding {self.name!r}: dims='adaptive' without a combiner "
                             "takes dense or ragged ids, got a SparseTensor or one-hot matmul")
        if self.cache_rows is not None and self.combiner is None and (
                isinstance(ids, tf.SparseTensor)
                or _tf_internals.uses_one_hot_matmul(self)):
            raise ValueError(f"Embedding {self.name!r}: cache_rows without a combiner takes "
                             "dense or ragged ids, got a SparseTensor or one-hot matmul")
        if self.combiner is None and (isinstance(ids, tf.SparseTensor)
                                      or getattr(self, "sparse", False)
                                      or _tf_internals.uses_one_hot_matmul(self)):
            # Keras' own semantics for SparseTensor ids (safe_embedding_lookup_sparse), a
            # SparseTensor output or the one-hot matmul are what a combiner-less table
            # promises; only Keras implements them.
            return super().call(ids)
        ids = _int_ids(ids)
        if self.cache_rows is not None:
            if _in_xla_context():
                raise ValueError(f"Embedding {self.name!r}: a table with cache_rows "
                                 "cannot be compiled with XLA (its cache is filled on the "
                                 "host before each lookup); keep it outside jit_compile")
            ids = self.table.slots(ids)   # the rows are in the cache from here on
        if self.combiner is None:
            if isinstance(ids, tf.RaggedTensor):
                out = tf.ragged.map_flat_values(self._lookup_flat, ids)
            else:
                out = self._lookup_dense(ids)
        else:
            out = self._lookup_combined(ids)
        return tf.cast(out, self.compute_dtype)

    def _lookup_option(self):
        # None lets custom_ops pick the fused op when it is loaded and the table is on a
        # CPU (and fall back, warning once, when it is not built); False forces plain TF.
        return None if self.use_custom_kernel else False

    def _params(self):
        """What lookups read: the table, or a tiered table's cache (ids are its slots).
        The ``tf.Variable`` itself, so that the fused op reads it by its handle (a Keras 3
        weight wraps one, and a lookup given the wrapper would read a copy of the table
        through plain TF ops); gradients still reach the weight, which shares the handle."""
        if self.cache_rows is not None:
            return self.table.cache
        return _tf_internals.tf_variable(self.embeddings)

    def _lookup_flat(self, flat_ids):
        """[N] ids -> [N, output_dim] rows (no combine)."""
        if self.dims == "adaptive":
            return self.table.lookup(flat_ids)
        if _in_xla_context():
            return tf.gather(self.embeddings, flat_ids)  # what Keras' Embedding compiles to
        return custom_ops.embedding_lookup_combine(
            self._params(), flat_ids, combiner=None, table_name=self.name,
            use_custom_op=self._lookup_option())

    def _lookup_dense(self, ids):
        """Dense ids of any rank -> ids.shape + [output_dim]."""
        if ids.shape.rank is None:
            raise ValueError(f"Embedding {self.name!r}: ids need a known rank; got shape "
                             f"{ids.shape}")
        rows = self._lookup_flat(tf.reshape(ids, [-1]))
        out = tf.reshape(rows, tf.concat([tf.shape(ids), [self.output_dim]], 0))
        out.set_shape(ids.shape.concatenate([self.output_dim]))
        return out

    def _lookup_combined(self, ids):
        if isinstance(ids, tf.SparseTensor):
            if ids.shape.rank != 2:
                raise ValueError(f"Embedding {self.name!r}: a SparseTensor input must be "
                                 f"[batch, max_hotness]; got shape {ids.shape}")
            # A row's ids are combined whatever their columns (gaps allowed, as in
            # distributed-embeddings), so only the row of each value matters.
            ids = tf.sparse.reorder(ids)
            ids = tf.RaggedTensor.from_value_rowids(ids.values, ids.indices[:, 0],
                                                    nrows=ids.dense_shape[0])
        if isinstance(ids, tf.RaggedTensor):
            if ids.shape.rank != 2 or ids.ragged_rank != 1:
                raise ValueError(f"Embedding {self.name!r}: a RaggedTensor input with "
                                 f"combiner={self.combiner!r} must be [batch, None]; got "
                                 f"shape {ids.shape} (ragged_rank {ids.ragged_rank})")
            return self._combine(ids)
        rank = ids.shape.rank
        if rank is None:
            raise ValueError(f"Embedding {self.name!r}: ids need a known rank; got shape "
                             f"{ids.shape}")
        if rank == 0:
            raise ValueError(f"Embedding {self.name!r}: combiner={self.combiner!r} needs ids "
                             f"of rank >= 1; got a scalar")
        if rank == 1:
            if not self._logged_1d:
                _LOG.info("Embedding %r: 1-D ids with combiner=%r are one id per sample "
                          "([batch] -> [batch, output_dim]); distributed-embeddings raises "
                          "ValueError for them", self.name, self.combiner)
                self._logged_1d = True
            return self._combine(tf.expand_dims(ids, 1))
        if rank == 2:
            return self._combine(ids)
        # [d1, ..., dn] -> bags [d1*...*d(n-1), dn] -> [d1, ..., d(n-1), output_dim]
        hotness = ids.shape[-1] if ids.shape[-1] is not None else tf.shape(ids)[-1]
        pooled = self._combine(tf.reshape(ids, [-1, hotness]))
        out = tf.reshape(pooled, tf.concat([tf.shape(ids)[:-1], [self.output_dim]], 0))
        out.set_shape(ids.shape[:-1].concatenate([self.output_dim]))
        return out

    def _lookup_weighted(self, ids, weights):
        """Bags of ``ids`` with per-id ``weights``, combined through the weighted
        kernel (for ``mean`` and ``sqrtn`` without the ids of weight <= 0)."""
        if self.combiner is None:
            raise ValueError(f"Embedding {self.name!r}: weights need a combiner ('sum', "
                             "'mean' or 'sqrtn'); the layer has combiner=None")
        ids, weights = _ragged_pair(self.name, ids, weights)
        flat_weights = tf.cast(weights.flat_values, tf.float32)
        # safe_embedding_lookup_sparse's rule: a sum keeps every id
        kept = (tf.ones_like(flat_weights, tf.bool) if self.combiner == "sum"
                else flat_weights > 0)
        kept, counts, kept_weights = kept_in_bags(ids.flat_values, ids.row_lengths(), kept,
                                                  flat_weights)
        bags = tf.RaggedTensor.from_row_lengths(kept, counts, validate=False)
        bag_weights = tf.RaggedTensor.from_row_lengths(kept_weights, counts, validate=False)
        if self.cache_rows is not None:
            bags = self.table.slots(bags)
        if self.dims == "adaptive":
            return self.table.lookup_combine(bags, self.combiner, kept_weights)
        return custom_ops.embedding_lookup_combine(
            self._params(), bags, combiner=self.combiner, table_name=self.name,
            use_custom_op=self._lookup_option(), weights=bag_weights)

    def _combine(self, ids):
        if self.dims == "adaptive":
            return self.table.lookup_combine(ids, self.combiner)
        if _in_xla_context() and not isinstance(ids, tf.RaggedTensor):
            return _combine_dense_plain(self.embeddings, ids, self.combiner)
        return custom_ops.embedding_lookup_combine(
            self._params(), ids, combiner=self.combiner, table_name=self.name,
            use_custom_op=self._lookup_option())

    # ------------------------------------------------------------------ shapes
    def compute_output_shape(self, input_shape):
        if self.combiner is None:
            return super().compute_output_shape(input_shape)
        shape = tf.TensorShape(input_shape)
        if shape.rank == 1:
            return tf.TensorShape([shape[0], self.output_dim])
        return shape[:-1].concatenate([self.output_dim])

    def compute_mask(self, inputs, mask=None):
        if self.combiner is not None:
            return None  # the id axis is combined away
        return super().compute_mask(inputs, mask)

    def get_config(self) -> dict:
        config = dict(super().get_config(), combiner=self.combiner,
                      use_custom_kernel=self.use_custom_kernel)
        if self.dims is not None:   # a dense table's config stays distributed-embeddings'
            config.update(dims=self.dims, chunks=self.chunks,
                          target_memory=self.target_memory)
        if self.cache_rows is not None:
            config.update(cache_rows=self.cache_rows, store_dir=self.store_dir,
                          cache_policy=self.cache_policy)
        return config


def _check_tier(cache_rows, store_dir, cache_policy, kwargs) -> None:
    """ValueError naming the value for a tiered table's options that cannot work."""
    if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 1:
        raise ValueError(f"cache_rows={cache_rows!r} must be None (all rows in memory) or "
                         "an int >= 1")
    if not isinstance(store_dir, str) or not store_dir:
        raise ValueError(f"cache_rows={cache_rows} needs store_dir, the folder of the "
                         f"table's file; got store_dir={store_dir!r}")
    if cache_policy not in POLICIES:
        raise ValueError(f"cache_policy={cache_policy!r} is unknown; expected one of "
                         f"{POLICIES}")
    unsupported = [k for k in ("sparse", "mask_zero", "embeddings_regularizer",
                               "embeddings_constraint") if kwargs.get(k)]
    if unsupported:
        raise ValueError(f"cache_rows does not support {unsupported}: got "
                         f"{ {k: kwargs[k] for k in unsupported} }")


def _block_initializer(initializer, dim: int):
    """``initializer`` as the tier's ``(start, stop) -> rows`` (a table larger than memory
    is drawn a block at a time). A seeded Keras initializer gives the same values at every
    call, so each block draws with its own seed (the seed plus the block's first row)."""
    config = initializer.get_config()
    seeded = config.get("seed") is not None

    def rows(start: int, stop: int):
        init = initializer
        if seeded:
            init = initializer.__class__.from_config(dict(config, seed=config["seed"] + start))
        with tf.device("/CPU:0"):
            return init(shape=(stop - start, dim), dtype=tf.float32).numpy()
    return rows


def _in_xla_context() -> bool:
    """True while tracing for XLA (jit_compile): neither the fused op nor the range checks
    of custom_ops' pure-TF path (StringFormat, Assert) have XLA kernels, so lookups there
    are plain gathers, which XLA compiles (clamping out-of-range ids, as for Keras)."""
    return _tf_internals.in_xla_context()


def _combine_dense_plain(params, ids, combiner: str):
    """[B, H] ids -> [B, D] with plain ops; half-precision tables accumulate in float32."""
    rows = tf.gather(params, ids)
    acc_dtype = tf.float32 if rows.dtype in (tf.float16, tf.bfloat16) else rows.dtype
    out = tf.reduce_sum(tf.cast(rows, acc_dtype), axis=1)
    if combiner == "mean":
        out = out / tf.cast(tf.maximum(tf.shape(ids)[1], 1), acc_dtype)
    return tf.cast(out, rows.dtype)


def _ragged_pair(name: str, ids, weights) -> tuple:
    """``ids`` and their ``weights`` as [batch, None] ragged tensors of one row layout;
    ``ValueError`` naming the layer when their forms or static shapes differ."""
    def ragged(x, what):
        if isinstance(x, tf.SparseTensor):
            if x.shape.rank != 2:
                raise ValueError(f"Embedding {name!r}: sparse {what} must be [batch, None]; "
                                 f"got shape {x.shape}")
            return tf.RaggedTensor.from_sparse(tf.sparse.reorder(x))
        if isinstance(x, tf.RaggedTensor):
            return x
        x = tf.convert_to_tensor(x)
        if x.shape.rank == 1:
            x = x[:, None]
        if x.shape.rank != 2:
            raise ValueError(f"Embedding {name!r}: {what} with weights must be [batch] or "
                             f"[batch, hotness]; got shape {x.shape}")
        return tf.RaggedTensor.from_tensor(x)
    def form(x):
        return ("sparse" if isinstance(x, tf.SparseTensor) else
                "ragged" if isinstance(x, tf.RaggedTensor) else "dense")
    if form(ids) != form(weights):
        raise ValueError(f"Embedding {name!r}: ids are {form(ids)} but weights "
                         f"{form(weights)}; expected weights of the ids' form and shape")
    weight_dtype = weights.dtype if hasattr(weights, "dtype") else tf.convert_to_tensor(
        weights).dtype
    if not tf.as_dtype(weight_dtype).is_floating:
        raise ValueError(f"Embedding {name!r}: weights have dtype {tf.as_dtype(weight_dtype).name}"
                         "; expected a float dtype")
    ids, weights = ragged(ids, "ids"), ragged(weights, "weights")
    if not weights.shape.is_compatible_with(ids.shape):
        raise ValueError(f"Embedding {name!r}: weights have shape {weights.shape}; expected "
                         f"the ids' shape {ids.shape}")
    return ids, weights


def _int_ids(ids):
    """Casts non-integer ids to int32, as Keras' Embedding does (floats are truncated)."""
    if isinstance(ids, tf.RaggedTensor):
        if ids.dtype in (tf.int32, tf.int64):
            return ids
        return ids.with_flat_values(tf.cast(ids.flat_values, tf.int32))
    if isinstance(ids, tf.SparseTensor):
        if ids.dtype in (tf.int32, tf.int64):
            return ids
        return tf.SparseTensor(ids.indices, tf.cast(ids.values, tf.int32), ids.dense_shape)
    ids = tf.convert_to_tensor(ids)
    if ids.dtype in (tf.int32, tf.int64):
        return ids
    return tf.cast(ids, tf.int32)
