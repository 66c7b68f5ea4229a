"""FIITED's adjustment of a ``DistributedEmbedding``'s adaptive tables over the mesh.

A sharded table is planned whole from its shards' utilities summed over the model group
(a column slice's utility is its part of the row's), and each shard keeps its part of
that plan, so every mesh prunes alike. The stores answer through their per-row widths
(``TableStore.widths``: a FIITED pool's, or a tier's over FIITED chunks).

Example (one process; under horovodrun every rank calls the same)::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, Embedding
    tfhybrid.init(model_parallel=1)
    layer = DistributedEmbedding([Embedding(10, 8, dims="adaptive", chunks=4,
                                            target_memory=0.5)])
    layer([tf.constant([1, 2])])
    assert list(layer.adjust().values()) == [20]     # of 10 rows x 4 chunks
    assert layer.chunks_per_row()[0].sum() == 20
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.fiited.table import plan_chunk_counts
from tfhybrid.plan.types import Kind, ShardingPlan
from tfhybrid.sharding.tables import TableSpec


class ShardedWidths:
    """The per-row widths of one layer's adaptive tables, over the shards its ranks hold
    (module docstring). Every method is collective over the model group.

    Example::

        import numpy as np
        import tensorflow as tf
        import tfhybrid
        from tfhybrid.fiited.sharded import ShardedWidths
        from tfhybrid.layers import DistributedEmbedding, Embedding
        mesh = tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([Embedding(10, 8, dims="adaptive", chunks=4)])
        layer([tf.constant([1, 2])])
        counts = {0: np.full([10], 4, np.uint8)}
        widths = ShardedWidths("emb", mesh, layer.plan, layer.table_specs, layer.stores,
                               counts)
        assert list(widths.adjust(lambda table: 0.25).values()) == [10]
        assert counts[0].tolist() == [1] * 10
    """

    def __init__(self, name: str, mesh: mesh_lib.Mesh, plan: ShardingPlan,
                 tables: Sequence[Any], stores: Any,
                 whole_chunk_counts: dict[int, np.ndarray]):
        self._name = name
        self._mesh = mesh
        self._plan = plan
        self._tables = list(tables)
        self._stores = stores
        # per adaptive table, every row's chunk count as every rank planned it at the
        # last adjustment (the layer's dict: checkpoints read and restore it too)
        self._whole_chunk_counts = whole_chunk_counts

    def _widths(self, t: int, s: int) -> Any:
        """The per-row widths of table ``t``'s shard ``s`` if this rank holds it."""
        store = self._stores.get(t, s)
        return None if store is None else store.widths

    def adjust(self, target_of: Callable[[TableSpec], float]) -> dict[str, int]:
        """FIITED's adjustment of every adaptive table to ``target_of(table)`` of its
        chunks; returns the chunks each keeps, by table name.

        A sharded table is planned whole from its shards' utilities summed over the
        model group (a column slice's utility is its part of the row's), and each shard
        keeps its part of that plan, so every mesh prunes alike.
        """
        adaptive = [t for t, table in enumerate(self._tables) if table.chunks]
        if not adaptive:
            raise ValueError(f"DistributedEmbedding {self._name!r}.adjust(): no table has "
                             "dims='adaptive'")
        mesh = self._mesh
        sharded = [t for t in adaptive if self._plan.tables[t].kind != Kind.DATA_PARALLEL]
        # each sharded table's utility per row, whole: this rank's shards in place, summed
        # over the model group (every row is held by one shard per column slice)
        utilities = []
        for t in sharded:
            whole = np.zeros([self._tables[t].rows], np.float32)
            for s, shard in enumerate(self._plan.tables[t].shards):
                chunked = self._widths(t, s)
                if chunked is not None:
                    whole[shard.row_start:shard.row_end] += chunked.utility.numpy()
            utilities.append(whole)
        if utilities and mesh.model_parallel > 1:
            summed = collectives.allreduce(tf.constant(np.concatenate(utilities)), hvd.Sum,
                                           f"tfhybrid_{self._name}_fiited_utility",
                                           mesh.model_process_set).numpy()
            utilities = np.split(summed, np.cumsum([len(u) for u in utilities])[:-1])
        kept = {}
        for t in adaptive:
            table, placement = self._tables[t], self._plan.tables[t]
            target = target_of(table)
            if placement.kind == Kind.DATA_PARALLEL:
                # every rank's copy has the same utility (its gradient is synced)
                chunked = self._widths(t, 0)
                kept[table.name] = chunked.adjust(target)["present"]
                self._whole_chunk_counts[t] = chunked.chunks_per_row().astype(
                    np.min_scalar_type(table.chunks))
                continue
            counts = plan_chunk_counts(utilities[sharded.index(t)], table.chunks, target)
            kept[table.name] = int(counts.sum())
            self._whole_chunk_counts[t] = counts.astype(np.min_scalar_type(table.chunks))
            for s, shard in enumerate(placement.shards):
                chunked = self._widths(t, s)
                if chunked is None:
                    continue
                # the row's chunks that fall in this column slice (a prefix of them)
                first = shard.col_start // table.chunk_dim
                chunked.resize(np.clip(counts[shard.row_start:shard.row_end] - first, 0,
                                       chunked.chunks))
        return kept

    def chunks_per_row(self) -> list:
        """Per table, how many chunks each row holds (None for a dense table)."""
        mesh = self._mesh
        counts = []
        for t, (table, placement) in enumerate(zip(self._tables, self._plan.tables)):
            if not table.chunks:
                counts.append(None)
                continue
            if placement.kind == Kind.DATA_PARALLEL:
                counts.append(self._widths(t, 0).chunks_per_row())
                continue
            whole = np.zeros([table.rows], np.int32)
            for s, shard in enumerate(placement.shards):
                chunked = self._widths(t, s)
                if chunked is not None:
                    whole[shard.row_start:shard.row_end] += chunked.chunks_per_row()
            if mesh.model_parallel > 1:
                whole = collectives.allreduce(tf.constant(whole), hvd.Sum,
                                              f"tfhybrid_{self._name}_fiited_counts",
                                              mesh.model_process_set).numpy()
            counts.append(whole)
        return counts
