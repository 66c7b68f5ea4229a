"""FIITED's chunked embedding table: per-row dimensions that training adjusts.

FIITED (Fine-grained In-Training Embedding Dimension optimization, arXiv 2401.04408)
gives every row of a table its own width. A row's vector is split into ``chunks``
fixed-size chunks; the row keeps a prefix of them and its missing chunks read as zeros.
Rows live in a *pool* of chunks reached through a per-row index (the paper's "virtually
hashed, physically indexed" table), so a pruned chunk really frees memory:

* ``pool``: ``[present chunks + 1, dim / chunks]``, exactly the chunks some row holds,
  each row's chunks side by side, then one chunk of zeros that every pruned chunk reads
  (so a lookup is one gather; the zero chunk is never updated);
* ``row_offsets``: ``[rows + 1]`` int32, row i's chunks are pool slots
  ``row_offsets[i] .. row_offsets[i + 1] - 1`` (4 bytes per row, where a slot index per
  chunk would cost 4 bytes per chunk: a quarter of the pool for 4-float chunks);
* ``accumulator``: row-wise AdaGrad's one float per row, which stays with its row
  whatever happens to the row's chunks;
* ``utility``: per row, an exponential moving average of how often the row is looked up
  times its gradient's size (the paper's signal: here the squared norm of the row's summed
  gradient, so that column slices' utilities add up), updated by
  :meth:`ChunkedTable.apply`.

:meth:`ChunkedTable.adjust` re-divides a chunk budget (``target_memory`` of the dense
table's chunks) by utility: chunk ``j`` of row ``i`` scores
``sqrt(utility[i]) / (j + 1) ** position_power`` and the best-scoring chunks are kept, so every
row keeps a prefix (at least ``min_chunks``) and rows that grow important regain chunks
(as zeros: the row's output does not jump). The pool is then rebuilt at exactly the kept
size (the freed chunks' memory is what the grown ones use), so its bytes are always those
of the present chunks; while it is rebuilt the old and the new pool both exist.

This module is the table's storage and math: lookup, row-wise AdaGrad apply, utility
and adjustment, with C++ kernels for the lookups and the apply
(``tfhybrid.custom_ops.chunked_lookup`` / ``chunked_lookup_combine`` /
``chunked_rowwise_adagrad_apply``) and a
plain-TF path the tests hold them to. ``tfhybrid.layers.Embedding(dims="adaptive")`` is
the Keras layer on it; inside ``DistributedEmbedding`` each shard is a ChunkedTable and
the layer plans a sharded table whole (:func:`plan_chunk_counts` of its shards' summed
utilities), so every mesh prunes alike.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import custom_ops
from tfhybrid import roles
from tfhybrid import slot_owners
from tfhybrid.combiners import COMBINERS, bag_means, combined_bags
from tfhybrid.custom_ops import coalesce_rows, rowwise_adagrad_rows
from tfhybrid.optimizer_traits import Trains, trains_of

# The adjustment's defaults: chunks every row keeps, and how fast a row's later chunks lose
# score (see plan_chunk_counts).
MIN_CHUNKS = 1
POSITION_POWER = 3.0


def table_of(variable: Any) -> "ChunkedTable | None":
    """The ChunkedTable whose pool ``variable`` is, else None."""
    table = roles.role_of(variable).table
    return table if isinstance(table, ChunkedTable) else None


def refuse_other_optimizers(optimizer: Any, variable: Any, slot_name: Any) -> None:
    """The slot guard of ``_tf_internals``: only the row-wise AdaGrad optimizers train a
    FIITED pool, since only they update the chunks each row holds; any other Keras
    optimizer is refused by name when it is built with one or makes a slot for one,
    instead of failing in its update on the pool's shape. (A tier's FIITED cache has the
    tier's guard, ``_refuse_cache_slots`` in ``tfhybrid/tiers/cached_table.py``.)"""
    del slot_name
    table = table_of(variable)
    if table is None:     # (a tier's FIITED cache: the tier's own guard says it)
        return
    owner = slot_owners.slot_owner(optimizer, variable)
    if trains_of(owner) not in table.trained_by:
        raise ValueError(
            f"{type(owner).__name__} cannot train table {table.name!r}, a FIITED table "
            "(dims='adaptive') whose rows keep a prefix of their chunks: train it with "
            "tfhybrid.optimizers.RowWiseAdagrad or MomentumScaledRowWiseAdagrad (for a "
            "DistributedEmbedding, as DistributedOptimizer's embedding_optimizer)")


def checked_int(name: str, value: Any, low: int) -> int:
    """``value`` as an ``int`` if it is an integer (numpy's too, not bool) >= ``low``;
    else ``ValueError`` naming ``name`` and ``value``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_fraction(name: str, value: Any, low_open: bool = True) -> float:
    ok = (isinstance(value, (int, float, np.floating, np.integer))
          and not isinstance(value, bool) and math.isfinite(float(value))
          and (0.0 < float(value) if low_open else 0.0 <= float(value)) and float(value) <= 1.0)
    if not ok:
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def plan_chunk_counts(utility: Any, chunks: int, target_memory: float,
                      min_chunks: int = MIN_CHUNKS,
                      position_power: float = POSITION_POWER) -> np.ndarray:
    """Chunks per row of a table whose rows have ``utility`` ([rows]), under a budget of
    ``target_memory`` x (rows x ``chunks``) chunks.

    Chunk j of row i scores sqrt(utility[i]) / (j + 1) ** position_power (the utility is
    a mean squared gradient norm; its root is the norm's scale); the best scores win, ties
    by chunk position then row id, so each row keeps a prefix and the choice is
    deterministic. A larger power spreads the chunks more evenly over the rows. Every row
    keeps at least ``min_chunks`` (the budget is raised to that if needed).

    A sharded table is planned whole from the sum of its shards' utilities (a column
    slice's utility is its part of the row's squared norm), so every mesh decides alike.
    """
    target = ChunkedTable.check_target(target_memory)
    utility = np.asarray(utility, np.float64)
    rows = utility.shape[0]
    total = rows * chunks
    budget = max(int(math.floor(target * total)), rows * min_chunks)
    score = (np.sqrt(np.maximum(utility, 0.0))[:, None]
             / np.arange(1, chunks + 1)[None, :] ** position_power)
    position = np.broadcast_to(np.arange(chunks)[None, :], score.shape)
    row = np.broadcast_to(np.arange(rows)[:, None], score.shape)
    forced = position < min_chunks
    # lexsort: the last key is the primary one
    order = np.lexsort((row.ravel(), position.ravel(), -score.ravel(), ~forced.ravel()))
    keep = np.zeros(total, dtype=bool)
    keep[order[:budget]] = True
    return keep.reshape(rows, chunks).sum(axis=1)


def _combine_rows(lookup, ids, combiner: str):
    """[B, H] dense or [B, None] ragged ids -> [B, D] through ``lookup`` ([N] -> [N, D]);
    an empty bag gives zeros, ``"mean"`` divides by max(bag size, 1)."""
    if isinstance(ids, tf.RaggedTensor):
        rows = lookup(ids.flat_values)
        out = tf.math.unsorted_segment_sum(rows, ids.value_rowids(), ids.nrows())
        sizes = ids.row_lengths()[:, None]
    else:
        flat = lookup(tf.reshape(ids, [-1]))
        rows = tf.reshape(flat, tf.concat([tf.shape(ids), tf.shape(flat)[1:]], 0))
        rows.set_shape(ids.shape.concatenate(flat.shape[1:]))
        out = tf.reduce_sum(rows, axis=1)
        sizes = tf.shape(ids)[1]
    if combiner == "mean":
        # dense bags share one size: a scalar divisor, as the dense layer's lookup divides
        # (so the two stay equal bit for bit)
        out = out / tf.cast(tf.maximum(sizes, 1), out.dtype)
    return out


def combine_bags(ids, combiner: str, lookup, fused_sums, weights=None) -> tf.Tensor:
    """FIITED's bags: ``[B, H]`` dense or ``[B, None]`` ragged ``ids`` -> ``[B, dim]`` sums
    (``"mean"``: divided by max(bag size, 1)). ``fused_sums(flat ids, int64 row splits,
    weights)`` gives the bags' sums from one C++ kernel; None takes ``lookup`` ([N] ->
    [N, dim]) and a segment sum. The mean's division is outside the kernel, so its
    gradient is the same for every storage of the rows. ``weights`` (flat, one per id):
    weighted bags, combined by ``tfhybrid.combiners``."""
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    if weights is not None or combiner == "sqrtn":
        return _weighted_bags(ids, combiner, lookup, fused_sums, weights)
    if isinstance(ids, tf.RaggedTensor):
        flat, splits = ids.values, ids.row_splits
    else:
        ids = tf.convert_to_tensor(ids)
        if ids.shape.rank != 2:
            raise ValueError(f"dense ids must be [B, H], got shape {ids.shape}")
        flat = tf.reshape(ids, [-1])
        shape = tf.shape(ids, out_type=tf.int64)
        splits = tf.range(shape[0] + 1) * shape[1]
    if flat.dtype not in (tf.int32, tf.int64):
        raise ValueError(f"ids must be int32 or int64, got {flat.dtype}")
    if fused_sums is None:
        return _combine_rows(lookup, ids, combiner)
    out = fused_sums(flat, tf.cast(splits, tf.int64))
    if combiner == "mean":
        out = bag_means(out, splits[1:] - splits[:-1])
    out.set_shape([ids.shape[0], out.shape[1]])
    return out


def _weighted_bags(ids, combiner: str, lookup, fused_sums, weights) -> tf.Tensor:
    """:func:`combine_bags` with per-id ``weights`` (or ``"sqrtn"``): weighted sums, in
    the C++ kernel where ``fused_sums`` is given, then the combiner's division."""
    if not isinstance(ids, tf.RaggedTensor):
        ids = tf.RaggedTensor.from_tensor(tf.convert_to_tensor(ids))
    flat, splits = ids.values, tf.cast(ids.row_splits, tf.int64)
    if fused_sums is not None:
        sums = fused_sums(flat, splits, weights)
    else:
        rows = lookup(flat)
        if weights is not None:
            rows = rows * tf.cast(weights, rows.dtype)[:, None]
        sums = tf.math.unsorted_segment_sum(rows, ids.value_rowids(), ids.nrows())
    sums.set_shape([ids.shape[0], sums.shape[1]])
    return combined_bags(sums, combiner, splits[1:] - splits[:-1], weights)


def chunked_rowwise_rows(rows, accum_rows, g, chunk_present, learning_rate, epsilon, scale,
                         weight_decay) -> tuple[tf.Tensor, tf.Tensor]:
    """Row-wise AdaGrad (pure TF) of distinct rows ``rows`` ([U, dim]) with summed gradient
    rows ``g``, each holding the chunks ``chunk_present`` ([U, chunks] bool): (new rows,
    new accumulators). A row's ``mean(g**2)`` is over the entries it holds; the new rows'
    entries of absent chunks are meaningless (the caller writes the present ones). Shared
    by a pool (:class:`ChunkedTable`) and a tiered table's cache
    (``tfhybrid.tiers.ChunkedCachedTable``), so a row updates alike in both."""
    dim = g.shape[1]
    chunk_dim = dim // chunk_present.shape[1]
    present = tf.repeat(tf.cast(chunk_present, tf.float32), chunk_dim, axis=1)
    held = tf.reduce_sum(present, axis=1)
    square = tf.square(g)
    mean_square = tf.where(held == dim, tf.reduce_mean(square, axis=1),
                           tf.reduce_sum(square * present, axis=1) / tf.maximum(held, 1.0))
    scalars = [tf.cast(x, tf.float32) for x in (learning_rate, epsilon, scale, weight_decay)]
    return rowwise_adagrad_rows(rows, accum_rows, g, mean_square, *scalars)


def update_utility(utility: tf.Variable, decay: float, rows, g) -> None:
    """FIITED's utility update (pure TF): every row's times ``decay``, then the distinct
    looked-up ``rows`` gain ``(1 - decay)`` times their summed gradient's squared norm (its
    access frequency times its gradient's size; squared, so that the utilities of a row's
    column slices add up to the row's). The C++ ops do the same."""
    utility.assign(utility * decay)
    utility.scatter_nd_add(tf.cast(rows, tf.int32)[:, None],
                           (1.0 - decay) * tf.reduce_sum(tf.square(g), axis=1))


class ChunkOptions:
    """FIITED's options and its adjustment's plan, for any storage of chunked rows: a
    pool (:class:`ChunkedTable`) or a tiered table's cache
    (``tfhybrid.tiers.ChunkedCachedTable``). The storage has ``rows``, a ``utility``
    variable and :meth:`resize`."""

    def _set_chunk_options(self, dim, chunks, utility_decay, min_chunks, position_power,
                           use_custom_op) -> None:
        self.dim = checked_int("dim", dim, 1)
        self.chunks = checked_int("chunks", chunks, 1)
        if self.dim % self.chunks:
            raise ValueError(f"chunks={chunks} must divide dim={dim}")
        self.chunk_dim = self.dim // self.chunks
        self.utility_decay = _check_fraction("utility_decay", utility_decay, low_open=False)
        self.min_chunks = checked_int("min_chunks", min_chunks, 0)
        if self.min_chunks > self.chunks:
            raise ValueError(f"min_chunks={min_chunks} exceeds chunks={chunks}")
        if (isinstance(position_power, bool) or not isinstance(position_power, (int, float))
                or not 0.0 <= position_power < math.inf):
            raise ValueError(f"position_power must be a finite number >= 0, got "
                             f"{position_power!r}")
        self.position_power = float(position_power)
        if use_custom_op not in (None, True, False):
            raise ValueError(f"use_custom_op must be None, True or False, got "
                             f"{use_custom_op!r}")
        self.use_custom_op = use_custom_op

    @staticmethod
    def check_target(target_memory: Any) -> float:
        """``target_memory`` as a float in (0, 1], else ValueError naming it."""
        return _check_fraction("target_memory", target_memory)

    def plan_chunks(self, target_memory: float) -> np.ndarray:
        """Chunks per row under a budget of ``target_memory`` x (rows x chunks) chunks:
        :func:`plan_chunk_counts` of this table's utility."""
        return plan_chunk_counts(self.utility.numpy(), self.chunks, target_memory,
                                 self.min_chunks, self.position_power)

    def adjust(self, target_memory: float) -> dict:
        """Re-divides the chunks by utility: :meth:`resize` to :meth:`plan_chunks`."""
        return self.resize(self.plan_chunks(target_memory))

    def _checked_counts(self, chunks_per_row: Any) -> np.ndarray:
        """``chunks_per_row`` as int64 [rows] in [0, chunks], else ValueError naming it."""
        new_counts = np.asarray(chunks_per_row)
        if new_counts.shape != (self.rows,) or not np.issubdtype(new_counts.dtype, np.integer):
            raise ValueError(f"chunks_per_row must be {self.rows} integers, got shape "
                             f"{new_counts.shape} of {new_counts.dtype}")
        if new_counts.min() < 0 or new_counts.max() > self.chunks:
            raise ValueError(f"chunks_per_row must lie in [0, {self.chunks}], got values in "
                             f"[{new_counts.min()}, {new_counts.max()}]")
        return new_counts.astype(np.int64)


class ChunkedTable(ChunkOptions, tf.Module):
    """An embedding table whose rows keep a prefix of their chunks (FIITED storage).

    ``rows`` x ``dim`` float32, split into ``chunks`` chunks of ``dim // chunks`` (``dim``
    must divide). Starts with every chunk present: until :meth:`adjust` prunes, lookups and
    updates equal a dense table's bit for bit. ``add_weight``: the ``add_weight`` of the
    Keras layer that holds the table, whose weights its variables then are (Keras 3
    tracks and trains only those).

    Example::

        import tensorflow as tf
        from tfhybrid.fiited import ChunkedTable
        table = ChunkedTable(100, 8, chunks=4, seed=0)
        ids = tf.constant([3, 7, 3])
        table.apply(ids, tf.ones([3, 8]), learning_rate=0.1)
        table.adjust(target_memory=0.5)            # keep half of the 400 chunks
        assert table.present_chunks() == 200
        assert table.lookup(ids).shape == (3, 8)
    """

    # only a row-wise optimizer updates the chunks each row holds
    trained_by = frozenset({Trains.ROW_STATE})

    def __init__(self, rows: int, dim: int, chunks: int = 8, *,
                 initial_value: Any = None, seed: int | None = None,
                 utility_decay: float = 0.99, min_chunks: int = MIN_CHUNKS,
                 position_power: float = POSITION_POWER, use_custom_op: bool | None = None,
                 name: str | None = None, add_weight: Callable[..., Any] | None = None):
        _tf_internals.install_autograph_rule()
        super().__init__(name=name)
        self.rows = checked_int("rows", rows, 1)
        self._set_chunk_options(dim, chunks, utility_decay, min_chunks, position_power,
                                use_custom_op)
        # outside any function being traced (Keras 3 builds a layer first called in fit
        # inside its train function): the variables below are made from it there
        with tf.init_scope():
            if initial_value is None:
                initial_value = tf.random.stateless_uniform(
                    [self.rows, self.dim], seed=[0 if seed is None else int(seed), 0],
                    minval=-0.05, maxval=0.05)
            initial_value = tf.convert_to_tensor(initial_value, tf.float32)
        if initial_value.shape != (self.rows, self.dim):
            raise ValueError(f"initial_value has shape {initial_value.shape}; expected "
                             f"[{self.rows}, {self.dim}]")
        total = self.rows * self.chunks
        if total >= 2**31:
            raise ValueError(f"rows x chunks = {total} chunks exceed the int32 row offsets")
        # through the holding layer's add_weight: Keras 3 trains only a layer's weights
        variable = functools.partial(_tf_internals.table_variable, add_weight,
                                     table=self.name)
        self.pool = variable(
            lambda: tf.concat([tf.reshape(initial_value, [total, self.chunk_dim]),
                               tf.zeros([1, self.chunk_dim])], 0),
            shape=tf.TensorShape([None, self.chunk_dim]), name="pool")
        self.row_offsets = variable(
            lambda: tf.range(0, total + 1, self.chunks, dtype=tf.int32), trainable=False,
            name="row_offsets")
        self.accumulator = variable(lambda: tf.zeros([self.rows]), trainable=False,
                                    name="accumulator")
        self.utility = variable(lambda: tf.zeros([self.rows]), trainable=False,
                                name="utility")
        # how an optimizer finds the table of a pool gradient (table_of), the rows'
        # accumulators (row_accumulator: one per logical row, whatever the chunks do) and
        # who steps the pool (row_step: its update reads the chunks each row holds)
        roles.assign(self.pool, table=self, row_accumulator=self.accumulator,
                     row_step=self)
        _tf_internals.install_slot_guard(refuse_other_optimizers)

    @property
    def storage(self) -> tf.Variable:
        """The variable the lookups read and the optimizer updates: the pool."""
        return self.pool

    @property
    def row_state(self) -> tuple:
        """The variables besides the pool that hold the rows' state (they live where
        the pool does, and are broadcast and checkpointed with it)."""
        return (self.row_offsets, self.accumulator, self.utility)

    # ------------------------------------------------------------------ reading
    def _gather_rows(self, ids: tf.Tensor, pool: tf.Tensor | None = None
                     ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """([N, dim] rows with absent chunks zero, [N, chunks] pool slots, [N, chunks]
        whether each chunk is present); ``pool``: the pool's value, if already read."""
        pool = self.pool if pool is None else pool
        start = tf.gather(self.row_offsets, ids)
        count = tf.gather(self.row_offsets, ids + 1) - start
        position = tf.range(self.chunks, dtype=tf.int32)
        present = position[None, :] < count[:, None]
        # a pruned chunk reads the zero chunk after the present ones
        zero_chunk = tf.shape(pool)[0] - 1
        slots = tf.where(present, start[:, None] + position[None, :], zero_chunk)
        values = tf.gather(pool, slots)                                # [N, C, cd]
        return tf.reshape(values, [-1, self.dim]), slots, present

    def lookup(self, ids: Any) -> tf.Tensor:
        """Rows of ``ids`` (any shape S) as S + [dim]; a pruned chunk reads as zeros."""
        ids = tf.convert_to_tensor(ids)
        if ids.dtype not in (tf.int32, tf.int64):
            raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
        flat = tf.reshape(ids, [-1])
        tf.debugging.assert_less(flat, tf.cast(self.rows, flat.dtype),
                                 message=f"ChunkedTable {self.name!r}: an id >= rows "
                                         f"({self.rows})")
        tf.debugging.assert_non_negative(flat, message=f"ChunkedTable {self.name!r}: a "
                                                       f"negative id")
        rows = self._rows_with_row_gradient(tf.cast(flat, tf.int32))
        out = tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], 0))
        out.set_shape(ids.shape.concatenate([self.dim]))
        return out

    def _rows_with_row_gradient(self, ids: tf.Tensor) -> tf.Tensor:
        """[N, dim] rows whose gradient reaches :attr:`pool` as ``tf.IndexedSlices`` of
        the N gradient rows at the logical row ids (dense_shape [rows, dim]): the form a
        dense table's gradient has, which :meth:`apply_pool_gradient` sums per row like
        the dense path, with no per-chunk bookkeeping."""
        @tf.custom_gradient
        def rows_of(pool):
            def grad(upstream):
                return tf.IndexedSlices(upstream, ids, tf.constant([self.rows, self.dim]))
            rows = custom_ops.chunked_lookup(pool, self.row_offsets, ids, self.dim,
                                             self.use_custom_op)
            if rows is None:
                rows = self._gather_rows(ids, pool)[0]
            return rows, grad
        return rows_of(self.pool.read_value())

    def lookup_combine(self, ids: Any, combiner: str = "sum", weights: Any = None
                       ) -> tf.Tensor:
        """Bags of rows combined: ``[B, H]`` dense or ``[B, None]`` ragged ids ->
        ``[B, dim]`` sums (``"mean"``: divided by max(bag size, 1)).

        With the C++ ops, one fused kernel gathers and sums through the row offsets, and
        the pool's gradient arrives coalesced (each looked-up row once, duplicates summed
        in input order: ``tf.IndexedSlices`` at ascending logical ids); otherwise
        :meth:`lookup` and a segment sum. ``weights``: per-id weights (flat), each row
        times its weight in the kernel."""
        fused = custom_ops.custom_op_used(self.use_custom_op, self.pool)
        return combine_bags(ids, combiner, self.lookup,
                            self._fused_sums if fused else None, weights)

    def _fused_sums(self, flat: tf.Tensor, splits: tf.Tensor, weights: Any = None
                    ) -> tf.Tensor:
        return custom_ops.chunked_lookup_combine(self.pool, self.row_offsets, flat, splits,
                                                 self.dim, self.name, weights)

    def to_dense(self) -> tf.Tensor:
        """The [rows, dim] table this pool represents (pruned chunks as zeros)."""
        return self._gather_rows(tf.range(self.rows))[0]

    def chunks_per_row(self) -> np.ndarray:
        """How many chunks each row holds (a prefix of its chunks)."""
        return np.diff(self.row_offsets.numpy())

    def present_chunks(self) -> int:
        return int(self.row_offsets[-1])

    def pool_slots(self) -> int:
        """Chunks the pool holds for rows (its first dimension less the zero chunk; the
        variable's static shape is [None, chunk_dim] since adjusting resizes it)."""
        return int(tf.shape(self.pool)[0]) - 1

    def memory_bytes(self) -> dict:
        """Bytes held: the pool's present chunks, its zero chunk, the row offsets and the
        per-row state (AdaGrad accumulator, utility), and what a dense table + accumulator
        takes."""
        pool = self.pool_slots() * self.chunk_dim * 4
        zero_chunk = self.chunk_dim * 4
        index = (self.rows + 1) * 4
        state = 2 * self.rows * 4
        return {"pool": pool, "zero_chunk": zero_chunk, "row_offsets": index,
                "row_state": state, "total": pool + zero_chunk + index + state,
                "dense": self.rows * (self.dim + 1) * 4}

    # ------------------------------------------------------------------ training
    def apply(self, ids: Any, grad: Any, learning_rate: float, epsilon: float = 1e-8,
              scale: float = 1.0, weight_decay: float = 0.0) -> None:
        """Row-wise AdaGrad (FBGEMM EXACT_ROWWISE_ADAGRAD) on the present chunks of the
        rows ``ids`` given their gradient rows ``grad`` ([N, dim]), and the utility update.

        Duplicate ids are summed first (deterministic order). A row's ``mean(g**2)`` is
        over the entries it holds, so a row with every chunk updates exactly as
        :func:`tfhybrid.custom_ops.rowwise_adagrad_apply` does; a pruned chunk's gradient
        is dropped (it has nowhere to go)."""
        ids = tf.cast(tf.reshape(tf.convert_to_tensor(ids), [-1]), tf.int32)
        grad = tf.reshape(tf.convert_to_tensor(grad), [-1, self.dim])
        if custom_ops.custom_op_used(self.use_custom_op, self.pool, self.accumulator):
            custom_ops.chunked_rowwise_adagrad_apply(
                self.pool, self.accumulator, self.row_offsets, ids, grad, learning_rate,
                epsilon, scale, weight_decay, self.utility, self.utility_decay)
            return
        unique_ids, g = coalesce_rows(ids, grad)
        self._apply_rows(unique_ids, g, learning_rate, epsilon, scale, weight_decay)
        update_utility(self.utility, self.utility_decay, unique_ids, g)

    def apply_pool_gradient(self, grad: Any, learning_rate: float, epsilon: float = 1e-8,
                            scale: float = 1.0, weight_decay: float = 0.0) -> None:
        """:meth:`apply` for the gradient a tape gives :attr:`pool` for a model that called
        :meth:`lookup`: ``tf.IndexedSlices`` of gradient rows at logical row ids (what
        :meth:`lookup` registers), or a dense ``[rows, dim]`` tensor."""
        if not isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
            grad = tf.IndexedSlices(grad, tf.range(tf.shape(grad)[0]))
        self.apply(grad.indices, grad.values, learning_rate, epsilon, scale, weight_decay)

    def _apply_rows(self, unique_ids, g, learning_rate, epsilon, scale, weight_decay) -> None:
        """The update of distinct rows ``unique_ids`` with summed gradient rows ``g``."""
        rows, slots, chunk_present = self._gather_rows(unique_ids)
        new_rows, new_accum = chunked_rowwise_rows(
            rows, tf.gather(self.accumulator, unique_ids), g, chunk_present, learning_rate,
            epsilon, scale, weight_decay)
        self._write_present(slots, chunk_present, new_rows)
        self.accumulator.scatter_nd_update(unique_ids[:, None], new_accum)

    def _write_present(self, slots: tf.Tensor, present: tf.Tensor, rows: tf.Tensor) -> None:
        """Writes the present chunks of ``rows`` ([N, dim]) to their pool ``slots`` (both
        from :meth:`_gather_rows`); a pruned chunk's values have nowhere to go."""
        keep = tf.reshape(present, [-1])
        self.pool.scatter_nd_update(
            tf.boolean_mask(tf.reshape(slots, [-1]), keep)[:, None],
            tf.boolean_mask(tf.reshape(rows, [-1, self.chunk_dim]), keep))

    def read_rows(self, start: int, stop: int) -> tf.Tensor:
        """Rows ``start .. stop - 1`` as ``[stop - start, dim]`` (pruned chunks as zeros)."""
        return self._gather_rows(tf.range(start, stop))[0]

    def write_rows(self, start: int, values: Any) -> None:
        """Sets rows ``start ..`` to ``values`` ([n, dim]) where they hold chunks; the
        entries of pruned chunks are dropped (the row keeps its width)."""
        values = tf.convert_to_tensor(values, tf.float32)
        if values.shape.rank != 2 or values.shape[1] != self.dim or not (
                0 <= start and start + values.shape[0] <= self.rows):
            raise ValueError(f"write_rows: values of shape {values.shape} at row {start} "
                             f"do not fit a [{self.rows}, {self.dim}] table")
        _, slots, present = self._gather_rows(tf.range(start, start + values.shape[0]))
        self._write_present(slots, present, values)

    def _column_slots(self, chunk: int) -> np.ndarray:
        """Pool slots of chunk ``chunk`` of every row that holds it, rows in order."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk={chunk!r} must lie in [0, {self.chunks})")
        offsets = self.row_offsets.numpy()
        holding = np.flatnonzero(np.diff(offsets) > chunk)
        return offsets[holding] + chunk

    def read_chunk_column(self, chunk: int) -> tf.Tensor:
        """Chunk ``chunk`` of every row that holds it, rows in order:
        ``[rows holding it, chunk_dim]`` (a checkpoint's compact form of the pool)."""
        return tf.gather(self.pool, self._column_slots(chunk))

    def write_chunk_column(self, chunk: int, values: Any) -> None:
        """The inverse of :meth:`read_chunk_column` under the current layout."""
        slots = self._column_slots(chunk)
        values = tf.convert_to_tensor(values, tf.float32)
        if values.shape != (len(slots), self.chunk_dim):
            raise ValueError(f"write_chunk_column({chunk}): values of shape {values.shape};"
                             f" expected [{len(slots)}, {self.chunk_dim}] (the rows that "
                             "hold the chunk)")
        self.pool.scatter_nd_update(slots[:, None], values)

    # ------------------------------------------------------------------ weights files
    def _named_state(self) -> dict:
        return {"pool": self.pool, "row_offsets": self.row_offsets,
                "accumulator": self.accumulator, "utility": self.utility}

    def save_own_variables(self, store: Any) -> None:
        """Writes the table to ``store``, a Keras weights file's entry for the layer that
        holds it (``save_own_variables``): its variables by name, the pool as it is."""
        for key, variable in self._named_state().items():
            store[key] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        """Reads what :meth:`save_own_variables` wrote, the pool at its saved size."""
        names, expected = sorted(store.keys()), sorted(self._named_state())
        if names != expected:
            raise ValueError(f"the weights file holds {names} for FIITED table "
                             f"{self.name!r}, which saves {expected}")
        saved = {key: np.asarray(store[key]) for key in expected}
        present = int(saved["row_offsets"][-1]) if saved["row_offsets"].size else 0
        want = {"pool": (present + 1, self.chunk_dim), "row_offsets": (self.rows + 1,),
                "accumulator": (self.rows,), "utility": (self.rows,)}
        got = {key: value.shape for key, value in saved.items()}
        if got != want:
            raise ValueError(f"the weights file holds FIITED table {self.name!r} with "
                             f"shapes {got}; this table needs {want}")
        for key, variable in self._named_state().items():
            variable.assign(saved[key])

    # ------------------------------------------------------------------ adjusting
    def resize(self, chunks_per_row: Any) -> dict:
        """Gives row i its first ``chunks_per_row[i]`` chunks and rebuilds the pool at
        exactly that size.

        Returns counts: ``freed`` and ``grown`` chunks (a grown chunk starts at zero, in
        memory a freed one gave back) and ``present`` after."""
        new_counts = self._checked_counts(chunks_per_row)
        old_offsets = self.row_offsets.numpy().astype(np.int64)
        old_counts = np.diff(old_offsets)
        new_offsets = np.concatenate([[0], np.cumsum(new_counts)])
        kept = np.minimum(old_counts, new_counts)
        position = np.arange(self.chunks)[None, :]
        carried = position < kept[:, None]                  # [rows, chunks]
        source = (old_offsets[:-1, None] + position)[carried]
        target = (new_offsets[:-1, None] + position)[carried]
        old_pool = self.pool.numpy()
        pool = np.zeros((int(new_offsets[-1]) + 1, self.chunk_dim), old_pool.dtype)
        pool[target] = old_pool[source]
        del old_pool
        self.pool.assign(pool)
        self.row_offsets.assign(new_offsets.astype(np.int32))
        return {"freed": int(np.maximum(old_counts - new_counts, 0).sum()),
                "grown": int(np.maximum(new_counts - old_counts, 0).sum()),
                "present": int(new_offsets[-1])}
