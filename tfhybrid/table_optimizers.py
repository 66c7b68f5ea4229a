"""``TableOptimizers``: each table of ``DistributedEmbedding`` trained by a Keras optimizer
of its own, the embedding optimizer ``tfhybrid.DistributedOptimizer(dense, embedding_optimizer=
{"table": optimizer, ...})`` makes of a dict.

The gradient route applies the tables' gradients with the embedding optimizer, beside the
dense one; this one is made of several. Which optimizer a variable belongs to comes from
the plans of the built layers: a table's variables, wherever its plan puts them (table-,
column- or row-wise shards, or a replicated table's one variable), are that table's.
Each layer's alltoall anchor, which all its tables share and every rank has, is given to
every optimizer: so every rank applies (and clips) the same optimizers in the same order,
every optimizer makes its slots of the anchor on every rank, and checkpoints name each
table's slots by them alike on every mesh (``tfhybrid.checkpoint.slots``).
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping

from tfhybrid import _tf_internals
from tfhybrid import slot_owners
from tfhybrid.checkpoint import pieces
from tfhybrid.checkpoint import slots as checkpoint_slots
from tfhybrid.checkpoint import tables as checkpoint_tables
from tfhybrid.sharding.rank_stores import table_key

__all__ = ["TableOptimizers"]


class TableOptimizers(slot_owners.PerTableOptimizers, _tf_internals.Trackable):
    """One Keras optimizer per table, as ``tfhybrid.DistributedOptimizer``'s
    ``embedding_optimizer`` (a dict given there is made into one).

    Args:
      optimizers: table -> Keras optimizer. A table is named by its name (the
        ``Embedding`` layer's), or as ``"<layer name>/<table name>"`` where two layers
        have tables of one name (that key wins over the bare name). Every table of the
        model needs one (``ValueError`` names a table without). Tables given the same
        optimizer object share it (one optimizer, built once with all of them); each
        optimizer clips with its own settings over its own tables.

    Each optimizer is a checkpoint child of this one (``table_<its first key>``), so
    ``tf.train.Checkpoint``, ``save_weights`` and ``BackupAndRestore`` keep every
    table's slots, under names that do not depend on the mesh.

    Example (one process; under horovodrun the same code shards over the mesh)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        layer = tfhybrid.layers.DistributedEmbedding([
            tf.keras.layers.Embedding(100, 4, name="users"),
            tf.keras.layers.Embedding(50, 4, name="items")])
        optimizer = tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1),
            embedding_optimizer={"users": tf.keras.optimizers.Adagrad(0.1),
                                 "items": tf.keras.optimizers.Adam(0.01)})
        with tf.GradientTape() as tape:
            users, items = layer([tf.constant([[1], [2]]), tf.constant([[3], [4]])])
            loss = tf.reduce_sum(users) + tf.reduce_sum(items)
        variables = layer.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        per_table = optimizer.embedding_optimizer
        assert [type(o).__name__ for o in per_table.optimizers] == ["Adam", "Adagrad"]
    """

    def __init__(self, optimizers: Mapping[str, Any]):
        if not isinstance(optimizers, Mapping) or not optimizers:
            raise ValueError(f"optimizers={optimizers!r} must be a non-empty dict of table "
                             "name -> Keras optimizer")
        for key, optimizer in optimizers.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"table key {key!r} must be a table's name or "
                                 "'<layer name>/<table name>'")
            if not hasattr(optimizer, "apply_gradients") or not hasattr(optimizer,
                                                                         "get_config"):
                raise ValueError(f"table {key!r}: {optimizer!r} is not a Keras optimizer")
            if slot_owners.is_loss_scaling(optimizer) or hasattr(optimizer,
                                                                  "embedding_optimizer"):
                raise ValueError(f"table {key!r}: {optimizer!r} must be a plain Keras "
                                 "optimizer; loss scaling and the mesh route come from the "
                                 "optimizer it is passed with")
        self._by_key = dict(optimizers)
        # each optimizer object once, in the order of its first key
        self.optimizers: list = []
        for key in sorted(self._by_key):
            optimizer = self._by_key[key]
            if not any(optimizer is known for known in self.optimizers):
                self.optimizers.append(optimizer)
                _tf_internals.track_child(self, f"table_{key}", optimizer)
        # tf.Variable id -> (a weak reference to it, (table key, table name), or None for
        # a layer's anchor); made again from the built layers when a variable is missing
        self._index: dict[int, tuple[weakref.ref, tuple[str, str] | None]] = {}
        # the anchors of the layers it was given (as given: Keras' variables), whose
        # slots every optimizer makes
        self._anchors: list[weakref.ref] = []

    @property
    def by_table(self) -> dict:
        """The optimizers as given: table key -> optimizer."""
        return dict(self._by_key)

    # ------------------------------------------------------------ which owner
    def _reindex(self) -> None:
        index, known = {}, set()
        for layer in checkpoint_tables.built_layers():
            anchor = _tf_internals.tf_variable(layer.anchor)
            index[id(anchor)] = (weakref.ref(anchor), None)
            for spec, held in zip(layer.table_specs, pieces.layer_pieces(layer)):
                for _, variable in held:
                    variable = _tf_internals.tf_variable(variable)
                    index[id(variable)] = (weakref.ref(variable),
                                           (table_key(layer.name, spec), spec.name))
                known.update((table_key(layer.name, spec), spec.name))
        # a key naming no table is a typo: its table would train with another optimizer
        unknown = sorted(set(self._by_key) - known)
        if unknown:
            raise ValueError(f"the per-table optimizers name {unknown}, which no built "
                             f"DistributedEmbedding has; its tables: {sorted(known)}")
        self._index = index

    def _table_of(self, variable: Any) -> tuple[str, str] | None:
        """(table key, table name) of a table's variable; None for a layer's anchor."""
        variable = _tf_internals.tf_variable(variable)
        for attempt in range(2):
            entry = self._index.get(id(variable))
            if entry is not None and entry[0]() is variable:
                return entry[1]
            if attempt == 0:
                self._reindex()
        raise ValueError(f"variable {variable.name!r} is no table of a built "
                         "DistributedEmbedding: per-table optimizers train tables only")

    def _owner(self, key: str, name: str) -> Any:
        owner = self._by_key.get(key, self._by_key.get(name))
        if owner is None:
            raise ValueError(f"table {key!r} has no optimizer: the per-table optimizers "
                             f"name {sorted(self._by_key)}; give every table of the model "
                             "one, by its name or as '<layer name>/<table name>'")
        return owner

    def optimizer_for(self, variable: Any, table: str | None = None) -> Any:
        found = self._table_of(variable)
        if found is not None:
            return self._owner(*found)
        if table is not None:
            return self._owner(table, table.rsplit("/", 1)[-1])
        # an anchor: every optimizer has its slots (if of a kind with slots); the first
        # that does, the same for every anchor and on every rank
        return next((o for o in self.optimizers
                     if checkpoint_slots.slots_of(o, variable)), self.optimizers[0])

    def split(self, variables: list) -> list[tuple[Any, list[int]]]:
        anchors, owned = [], {id(o): [] for o in self.optimizers}
        for i, variable in enumerate(variables):
            found = self._table_of(variable)
            if found is None:
                anchors.append(i)
                if not any(a() is variable for a in self._anchors):
                    self._anchors.append(weakref.ref(variable))
            else:
                owned[id(self._owner(*found))].append(i)
        return [(o, sorted(owned[id(o)] + anchors)) for o in self.optimizers]

    # ------------------------------------------------------- Keras' protocol
    def build(self, var_list: Any) -> None:
        """Builds every optimizer with its tables' variables (and the anchors)."""
        var_list = list(var_list)
        for optimizer, members in self.split(var_list):
            _tf_internals.build_optimizer(optimizer, [var_list[i] for i in members])

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """Each optimizer applies its tables' gradients (the gradient route applies them
        the same way, each clipped by its own optimizer's settings first); returns the
        first optimizer's step count."""
        pairs = list(grads_and_vars)
        for optimizer, members in self.split([v for _, v in pairs]):
            if members:
                optimizer.apply_gradients([pairs[i] for i in members])
        return self.optimizers[0].iterations

    @property
    def built(self) -> bool:
        """Whether every optimizer was built with the anchors of the layers it was given
        (every optimizer is given every anchor), i.e. has made its slots; a legacy Keras
        optimizer makes them as it applies, and counts as built."""
        anchors = [a() for a in self._anchors if a() is not None]
        return bool(anchors) and all(hasattr(o, "get_slot_names") or all(
            _tf_internals.built_for(o, anchor) for anchor in anchors)
            for o in self.optimizers)

    @property
    def variables(self) -> list:
        """Every optimizer's variables, each once."""
        found, seen = [], set()
        for optimizer in self.optimizers:
            for variable in checkpoint_slots.variables_of(optimizer):
                if id(variable) not in seen:
                    seen.add(id(variable))
                    found.append(variable)
        return found
