"""A small hybrid-parallel click model and its single-process twin, for the parity tests.

``Case`` holds the tables, the data of the global batches and the initial weights; every
rank builds the same case from the same seed. ``distributed_model`` puts the tables in
one ``DistributedEmbedding``; ``reference_model`` is the same network from plain Keras
layers in one process, trained on the global batch: what the distributed run must equal.
Rank r feeds samples r, r+N, r+2N, ... of each global batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import DistributedEmbedding, Embedding

HIDDEN = 4


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    rows: int
    dim: int
    combiner: str | None
    hotness: int       # 0: [batch] ids; -1: ragged bags (some empty)


# "wide" is one shard (64*4 elements), "tiny" replicated (10*2, under the threshold).
# On M = 2 or M = 4 the positions after the first own no shard.
IDLE_TABLES = (Table("wide", 64, 4, "sum", 3), Table("tiny", 10, 2, None, 0))
# Every kind of placement: "rows" (96*3) row-sliced over every position, "wide" (64*4)
# in two column slices, "bag" (ragged, mean) table-wise, "tiny" replicated.
PLACEMENT_TABLES = (Table("wide", 64, 4, "sum", 3), Table("rows", 96, 3, "sum", 2),
                    Table("bag", 40, 2, "mean", -1), Table("tiny", 10, 2, None, 0))
PLANNERS = {IDLE_TABLES: dict(data_parallel_threshold=30),
            PLACEMENT_TABLES: dict(data_parallel_threshold=30, row_slice_threshold=270,
                                   column_slice_threshold=200)}


@dataclasses.dataclass
class Case:
    tables: tuple
    local_batch: int
    steps: int
    world: int
    seed: int = 0
    empty_rank: int | None = None   # this rank's ragged bags are all empty
    # FIITED: every table dims="adaptive" with one column per chunk, keeping this share
    adaptive_target: float | None = None
    # tiers: {table name: cache_rows} of the tables kept in files under store_dir
    cache_rows: dict | None = None
    store_dir: str | None = None

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        n = self.local_batch * self.world * self.steps
        # ragged tables' bags as numpy (values, lengths): batches are cut from these, as
        # cutting a tf.RaggedTensor in eager runs dozens of small ops per call
        ids = [self._ids(rng, t, n, self._empty_rows(n)) for t in self.tables]
        self._bags = {f: x for f, x in enumerate(ids) if isinstance(x, tuple)}
        self.ids = [tf.RaggedTensor.from_row_lengths(*x) if isinstance(x, tuple) else x
                    for x in ids]
        self.labels = rng.integers(0, 2, size=[n, 1]).astype(np.float32)
        self.table_values = [rng.normal(0, 0.3, [t.rows, t.dim]).astype(np.float32)
                             for t in self.tables]
        width = sum(t.dim for t in self.tables)
        self.dense_values = [rng.normal(0, 0.5, [width, HIDDEN]).astype(np.float32),
                             np.zeros([HIDDEN], np.float32),
                             rng.normal(0, 0.5, [HIDDEN, 1]).astype(np.float32),
                             np.zeros([1], np.float32)]

    def _empty_rows(self, n: int):
        if self.empty_rank is None:
            return np.zeros([n], bool)
        return np.arange(n) % self.world == self.empty_rank

    @staticmethod
    def _ids(rng, table: Table, n: int, empty_rows):
        if table.hotness == 0:
            return rng.integers(0, table.rows, size=[n])
        if table.hotness > 0:
            return rng.integers(0, table.rows, size=[n, table.hotness])
        lengths = np.where(empty_rows, 0, rng.integers(0, 4, size=[n]))  # some bags empty
        return rng.integers(0, table.rows, size=[int(lengths.sum())]), lengths

    # ------------------------------------------------------------- batches
    def _samples(self, rows: np.ndarray):
        """The ids of every table and the labels of the samples ``rows``, in that order."""
        ids = []
        for f, x in enumerate(self.ids):
            if f not in self._bags:
                # tensors, as the ragged bags are: Keras 3 takes no mix of the two
                ids.append(tf.constant(x[rows]))
                continue
            values, lengths = self._bags[f]
            starts = np.concatenate([[0], np.cumsum(lengths)])[rows]
            kept = lengths[rows]
            # value positions of the kept bags, each bag's run shifted to where it lands
            at = np.repeat(starts - (np.cumsum(kept) - kept), kept) + np.arange(kept.sum())
            ids.append(tf.RaggedTensor.from_row_lengths(values[at], kept))
        return ids, self.labels[rows]

    def global_batch(self, step: int):
        size = self.local_batch * self.world
        return self._samples(np.arange(step * size, (step + 1) * size))

    def local_batch_of(self, step: int, rank: int):
        size = self.local_batch * self.world
        return self._samples(np.arange(step * size + rank, (step + 1) * size, self.world))

    def local_data(self, rank: int):
        """All steps of this rank's input, in order (for ``fit`` with ``batch_size``):
        samples rank, rank + N, rank + 2N, ... of every global batch in turn."""
        return self._samples(np.arange(rank, self.local_batch * self.world * self.steps,
                                       self.world))

    # ------------------------------------------------------------- models
    def _inputs(self):
        inputs = []
        for t in self.tables:
            if t.hotness == 0:
                inputs.append(tf.keras.Input([], dtype=tf.int64, name=f"{t.name}_ids"))
            elif t.hotness > 0:
                inputs.append(tf.keras.Input([t.hotness], dtype=tf.int64, name=f"{t.name}_ids"))
            else:
                inputs.append(tf.keras.Input([None], dtype=tf.int64, ragged=True,
                                             name=f"{t.name}_ids"))
        return inputs

    def _head(self, embedded):
        joined = _Join([t.dim if t.hotness == 0 else None for t in self.tables])(embedded)
        hidden = tf.keras.layers.Dense(HIDDEN, activation="relu", name="hidden")(joined)
        return tf.keras.layers.Dense(1, name="logit", dtype="float32")(hidden)

    def embedding_layers(self):
        fiited = ({} if self.adaptive_target is None else
                  dict(dims="adaptive", target_memory=self.adaptive_target))
        cached = self.cache_rows or {}
        return [Embedding(t.rows, t.dim, combiner=t.combiner, name=t.name,
                          **(dict(fiited, chunks=t.dim) if fiited else {}),
                          **(dict(cache_rows=cached[t.name], store_dir=self.store_dir)
                             if t.name in cached else {}))
                for t in self.tables]

    def distributed_model(self, mesh, **layer_kwargs):
        inputs = self._inputs()
        layer = DistributedEmbedding(self.embedding_layers(), mesh=mesh,
                                     **dict(PLANNERS.get(self.tables, {}), **layer_kwargs))
        model = tf.keras.Model(inputs, self._head(layer(inputs)))
        layer.set_weights(self.table_values)
        self._set_dense(model)
        return model, layer

    def compiled_model(self, mesh, make_optimizer, steps_per_execution=1, **layer_kwargs):
        """``distributed_model`` compiled with ``DistributedOptimizer(make_optimizer())``."""
        model, layer = self.distributed_model(mesh, **layer_kwargs)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer()),
                      loss=loss_fn, steps_per_execution=steps_per_execution)
        return model, layer

    def reference_model(self):
        inputs = self._inputs()
        embedded = [layer(x) for layer, x in zip(self.embedding_layers(), inputs)]
        model = tf.keras.Model(inputs, self._head(embedded))
        for table, values in zip(self.tables, self.table_values):
            layer = model.get_layer(table.name)
            if self.adaptive_target is None:
                layer.set_weights([values])
            else:
                layer.table.write_rows(0, values)
        self._set_dense(model)
        return model

    def _set_dense(self, model):
        model.get_layer("hidden").set_weights(self.dense_values[:2])
        model.get_layer("logit").set_weights(self.dense_values[2:])


class _Join(tf.keras.layers.Layer):
    """The embeddings side by side in float32 (a layer: Keras 3 takes no TF op on its
    symbolic inputs); ``[batch]`` ids' vectors come flattened to their width."""

    def __init__(self, flatten_to, **kwargs):
        super().__init__(**kwargs)
        self.flatten_to = flatten_to

    def call(self, embedded):
        return tf.concat([tf.cast(e if dim is None else tf.reshape(e, [-1, dim]), tf.float32)
                          for e, dim in zip(embedded, self.flatten_to)], axis=1)


def concat_samples(parts):
    if isinstance(parts[0], tf.RaggedTensor):
        return tf.concat(parts, axis=0)
    return np.concatenate(parts)


def loss_fn(labels, logits, sample_weight=None):
    return tf.keras.losses.BinaryCrossentropy(from_logits=True)(labels, logits,
                                                                  sample_weight=sample_weight)


def table_weights(layer) -> list:
    """Full tables of a DistributedEmbedding, on every rank."""
    return layer.get_weights(all_ranks=True)


def model_weights(model, layer) -> list:
    """Every table of ``layer`` (whole) and the dense weights of ``model``."""
    return table_weights(layer) + dense_weights(model)


def reference_tables(model, case: Case) -> list:
    if case.adaptive_target is not None:
        return [model.get_layer(t.name).table.to_dense().numpy() for t in case.tables]
    return [model.get_layer(t.name).get_weights()[0] for t in case.tables]


def dense_weights(model) -> list:
    return model.get_layer("hidden").get_weights() + model.get_layer("logit").get_weights()


def world_size() -> int:
    world = tfhybrid.init(model_parallel=1).size
    from tfhybrid import mesh as mesh_lib
    mesh_lib.reset()
    return world


def meshes_for_this_keras(meshes: list) -> list:
    """The share of ``meshes`` (M, or (M, layout) pairs) a parity loop runs under this
    Keras: the M = 2 ones (2 x 2 on four ranks: both halves of the route, both layouts)
    under Keras 3, the others (the 1D meshes) under Keras 2; all of them where one share
    is empty. Which Keras runs changes the optimizers and variables, not the route, so
    the two runs of the suite together hold every mesh once, and each Keras trains on
    2 x 2 in the tests of its own code (test_gradient_route's tape against fit,
    test_stock_optimizers, test_pipeline, the app).

    >>> import unittest.mock
    >>> with unittest.mock.patch.object(tfhybrid, "keras_major", lambda: 2):
    ...     meshes_for_this_keras([1, 2, 4]), meshes_for_this_keras([2])
    ([1, 4], [2])
    """
    hybrid = [m for m in meshes if (m[0] if isinstance(m, tuple) else m) == 2]
    one_dimensional = [m for m in meshes if m not in hybrid]
    share = hybrid if tfhybrid.keras_major() == 3 else one_dimensional
    return share or list(meshes)
