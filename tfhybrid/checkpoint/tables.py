"""What a checkpoint holds of a ``DistributedEmbedding``: its tables, under names that do
not depend on the mesh, through TensorFlow's own checkpoints.

Every Keras and TensorFlow path (``model.save_weights`` / ``load_weights``,
``tf.train.Checkpoint`` + ``CheckpointManager``, ``ModelCheckpoint``,
``BackupAndRestore``) walks the object graph and asks each object for its state; this
module answers for the layer (``slots`` answers for the optimizer):

- **Tables.** The layer's checkpoint children are replaced by one node, ``tables``,
  whose attribute ``table_<t>`` is table t as ONE tensor of its full shape
  ``[rows, dim]``. Each rank offers the rectangles it holds (its shards, or the whole of
  a data-parallel table) as slices of that tensor (``pieces``); the writer
  (``tfhybrid/checkpoint/writer.py``) writes every slice once. Restoring asks for the
  rectangles of the CURRENT plan, and TensorFlow's reader assembles each from the saved
  slices that overlap it, so a checkpoint restores onto any mesh and any plan. Names
  depend on the table's index in the layer (checked by shape), not on Keras' per-process
  layer names. The per-shard variables are not checkpoint children: their names and
  number depend on the mesh.
- **A kind's own layout.** A table whose storage kind has a saved layout of its own
  (``tfhybrid.sharding.stores.saved_layout_of``: a FIITED table's compact chunks,
  ``tfhybrid.fiited.saved``) is saved by it instead; its shape may depend on the saved
  layout, so the restore hook (``_tf_internals.install_restore_hook``) makes the path
  of the checkpoint being restored known while TensorFlow gathers what each object
  restores.
- **Restore before build.** ``BackupAndRestore`` and ``load_weights`` may restore before
  a subclassed model has its layer. TensorFlow then defers the missing children, as it
  does for Keras' own lists; the layer (``register_layer``, at the end of its build)
  hands the deferred restorations its tables before the first step uses them.
"""

from __future__ import annotations

import weakref
from typing import Any

from tfhybrid import _tf_internals
from tfhybrid.checkpoint import pieces
from tfhybrid.checkpoint import writer
from tfhybrid.sharding.stores import saved_layout_of

# The layer's checkpoint child (part of the checkpoint format).
TABLES_CHILD = "tables"

# Built layers, so that an optimizer can tell which of its slots belong to tables.
# each built layer and its checkpoint node (held weakly: a dropped model leaves)
_NODES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ the layer
class _LayerTables(_tf_internals.Trackable):
    """The ``tables`` node of a built layer: one full-table attribute per table."""

    def __init__(self, layer: Any):
        self._layer = weakref.ref(layer)

    def _gather_saveables_for_checkpoint(self) -> dict:
        layer = self._layer()
        if layer is None:
            return {}
        saveables = {}
        for t, (table, held) in enumerate(zip(layer.table_specs, pieces.layer_pieces(layer))):
            layout = saved_layout_of(table)
            saveables[f"table_{t}"] = (
                layout.checkpoint_saveable(layer, t, held) if layout is not None else
                pieces.full_tensor_factory((table.rows, table.dim),
                                           [pieces.variable_piece(rect, var)
                                            for rect, var in held]))
        return saveables


def register_layer(layer: Any) -> None:
    """Called at the end of ``DistributedEmbedding.build``: the layer's tables become its
    checkpoint node, and a restore that ran before the build gets them now."""
    # from now on, saves that hold its shards are written by all ranks together, and a
    # restore names the checkpoint it reads (a FIITED table's saved shape depends on it)
    writer.install()
    _tf_internals.install_restore_hook()
    node = _LayerTables(layer)
    _NODES[layer] = node
    _tf_internals.restore_waiting_child(layer, TABLES_CHILD, node)


def layer_children(layer: Any, children: dict, save_type: Any) -> dict:
    """``DistributedEmbedding._trackable_children``: in a checkpoint, only the tables.

    Everything else the layer tracks is mesh-dependent (shard variables and the dicts
    holding them) or holds no state (the Embedding layers that describe the tables).
    SavedModel export keeps Keras' children.
    """
    if save_type != _tf_internals.SaveType.CHECKPOINT:
        return children
    node = _NODES.get(layer)
    return {TABLES_CHILD: node} if node is not None else {}


def built_layers() -> list:
    """The built ``DistributedEmbedding`` layers that are alive, in no particular order."""
    return list(_NODES)
