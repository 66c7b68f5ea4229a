"""How a dynamic table is saved: by key, so it restores onto any mesh and capacity.

A dynamic table's kind answers for its saved layout here, as ``tfhybrid.sharding.stores``
registers it (:data:`KEYED_ENTRIES`); checkpoints ask it. A checkpoint holds, under the
table's key ``<key>``:

- ``<key>``: the rows, ``[capacity, dim]``, and beside them, ``[capacity]`` each,
  ``<key>_accumulator`` (row-wise AdaGrad's), ``<key>_keys``, ``<key>_seen`` (the step
  call that last saw the slot; -1: a free slot) and ``<key>_count`` (sightings): every
  shard's slots, shard after shard, as the saving mesh placed them;
- with ``admit_after > 1``, the admission candidates the same way (``<key>_cand_keys``,
  ``_cand_seen``, ``_cand_count``);
- ``<key>_calls`` ``[M]`` (each shard's calls so far) and ``<key>_counters`` ``[M, 8]``.

Which slot holds a key is the saving mesh's business only: a restore reads every saved
slot, keeps the live ones (``seen >= 0``) whose key this rank's shard owns on the
restoring mesh (``mix64(key) mod M``) and loads them into its table in key order
(``DynamicTable.load_entries``), with the calls so far and the summed counters (on the
first position; the others start theirs from zero, so the model group's sums are the
saved ones). A shard that cannot hold its keys raises ``ValueError`` naming both numbers.

The table's optimizer state is its own accumulator, saved here: it has no optimizer
slots in the checkpoint (``saves_row_state``).

Example::

    from tfhybrid.dynamic.saved import KEYED_ENTRIES, SUFFIXES
    assert KEYED_ENTRIES.saves_row_state and SUFFIXES[0] == "_accumulator"
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import roles
from tfhybrid.checkpoint import resharding
from tfhybrid.checkpoint import writer
from tfhybrid.dynamic.keys import owner_of
from tfhybrid.dynamic.table import COUNTERS

# per slot, besides the rows: (suffix, the table's variable, dtype)
SLOT_STATE = (("_accumulator", "accumulator", tf.float32), ("_keys", "slot_keys", tf.int64),
              ("_seen", "slot_seen", tf.int64), ("_count", "slot_count", tf.int32))
CANDIDATES = (("_cand_keys", "cand_keys", tf.int64),
              ("_cand_seen", "cand_seen", tf.int64),
              ("_cand_count", "cand_count", tf.int32))
CALLS_SUFFIX, COUNTERS_SUFFIX = "_calls", "_counters"
SUFFIXES = tuple(s for s, _, _ in SLOT_STATE + CANDIDATES) + (CALLS_SUFFIX,
                                                               COUNTERS_SUFFIX)


def _held_tables(held: list) -> list[tuple[resharding.Rect, Any]]:
    """(rect, the DynamicTable whose rows the variable is) of held pieces."""
    return [(rect, roles.role_of(variable).table) for rect, variable in held]


class _KeyedSaveable(_tf_internals.SaveableObject):
    """One dynamic table's entries (module docstring). Saving, each rank offers its
    shards' slot ranges (``rect`` rows of the plan: the shard's slots); restoring, each
    asks for every saved slot, in the shapes the checkpoint being restored holds."""

    def __init__(self, name: str, spec: Any, held: list, position: int, positions: int):
        self._name, self._spec, self._held = name, spec, held
        self._position, self._positions = position, positions
        self._candidates = spec.keyed.admit_after > 1
        restoring = _tf_internals.restoring_path()
        specs = []
        if restoring is not None:
            self._restore_keys = self._saved_keys(restoring)
            reader_shapes = tf.train.load_checkpoint(restoring).get_variable_to_shape_map()
            # the device of the variables the values go to (a restore of pieces on
            # devices of several tasks would run in a tf.function)
            device = held[0][1].rows.device if held else "/cpu:0"
            for key, dtype in self._restore_keys:
                shape = [int(d) for d in reader_shapes[key]]
                rect = resharding.Rect(0, shape[0], 0, shape[1] if len(shape) == 2 else 1)
                specs.append(writer.PieceSpec(
                    lambda: tf.constant(0), resharding.slice_spec(shape, rect), key, dtype,
                    device, tuple(shape)))
            super().__init__(None, specs, name)
            return

        def piece(read, full_shape, rect, suffix, dtype, device):
            specs.append(writer.PieceSpec(
                read, resharding.slice_spec(full_shape, rect), name + suffix, dtype, device,
                rect.shape if len(full_shape) == 2 else rect.shape[:1]))

        capacity, dim = spec.rows, spec.dim
        for rect, table in held:
            device = table.rows.device
            piece(table.rows.read_value, (capacity, dim), rect, "", tf.float32, device)
            for suffix, attribute, dtype in SLOT_STATE:
                piece(getattr(table, attribute).read_value, (capacity,), rect, suffix,
                      dtype, device)
            if self._candidates:
                for suffix, attribute, dtype in CANDIDATES:
                    piece(getattr(table, attribute).read_value, (capacity,), rect, suffix,
                          dtype, device)
            at = resharding.Rect(self._position, self._position + 1, 0, 1)
            piece(lambda table=table: tf.reshape(table.calls.read_value(), [1]),
                  (positions,), at, CALLS_SUFFIX, tf.int64, device)
            piece(lambda table=table: tf.reshape(table.counters.read_value(), [1, -1]),
                  (positions, table.counters.shape[0]),
                  resharding.Rect(self._position, self._position + 1, 0,
                                  table.counters.shape[0]), COUNTERS_SUFFIX, tf.int64, device)
        super().__init__(None, specs, name)

    def _saved_keys(self, path: str) -> list[tuple[str, Any]]:
        """The checkpoint keys this table restores from, with their dtypes; ValueError
        names a checkpoint that does not hold the table by key."""
        reader = tf.train.load_checkpoint(path)
        wanted = [(self._name, tf.float32)] + [(self._name + s, d) for s, _, d in SLOT_STATE]
        wanted += [(self._name + CALLS_SUFFIX, tf.int64), (self._name + COUNTERS_SUFFIX, tf.int64)]
        missing = [key for key, _ in wanted if not reader.has_tensor(key)]
        if missing:
            raise ValueError(
                f"checkpoint {path!r} holds dynamic table {self._spec.name!r} without "
                f"{missing}: it was saved as another kind of table; restore it into a "
                "layer of the same kind")
        shape = reader.get_variable_to_shape_map()[self._name]
        if len(shape) != 2 or shape[1] != self._spec.dim:
            raise ValueError(f"checkpoint {path!r} holds dynamic table {self._spec.name!r} "
                             f"with rows of shape {shape}; this table has dim "
                             f"{self._spec.dim}")
        if self._candidates and reader.has_tensor(self._name + CANDIDATES[0][0]):
            wanted += [(self._name + s, d) for s, _, d in CANDIDATES]
        return wanted

    @property
    def device(self) -> str:
        return self.specs[0].device if self.specs else "/cpu:0"

    def restore(self, restored_tensors, restored_shapes):
        del restored_shapes
        if not tf.executing_eagerly():
            raise RuntimeError("a dynamic table is restored eagerly (its keys are placed)")
        saved = {key[len(self._name):]: np.asarray(value)
                 for (key, _), value in zip(self._restore_keys, restored_tensors)}
        load_by_key(saved, [table for _, table in self._held], self._position,
                    self._positions)
        return tf.no_op()


def load_by_key(saved: dict, tables: list, position: int, positions: int) -> None:
    """Loads the entries of ``saved`` (by suffix: ``""`` the rows, then
    :data:`SUFFIXES`, as a checkpoint or weights file holds them) that ``position`` of
    ``positions`` owns into each of ``tables`` (this rank's shards of the table)."""
    live = saved["_seen"] >= 0
    keys = saved["_keys"][live]
    mine = owner_of(tf.constant(keys, tf.int64), positions).numpy() == position
    entries = {name: saved[suffix][live][mine] for suffix, name in
               (("", "rows"), ("_accumulator", "accumulator"), ("_seen", "seen"),
                ("_count", "count"))}
    candidates = None
    if "_cand_keys" in saved:
        waiting = saved["_cand_seen"] >= 0
        cand_keys = saved["_cand_keys"][waiting]
        cand_mine = owner_of(tf.constant(cand_keys, tf.int64), positions).numpy() == position
        candidates = {"keys": cand_keys[cand_mine],
                      "seen": saved["_cand_seen"][waiting][cand_mine],
                      "count": saved["_cand_count"][waiting][cand_mine]}
    # the model group's counters sum to the saved ones: the first position keeps them
    counters = saved[COUNTERS_SUFFIX].sum(axis=0) if position == 0 else \
        np.zeros_like(saved[COUNTERS_SUFFIX][0])
    for table in tables:
        table.load_entries(keys[mine], candidates=candidates,
                           calls=int(saved[CALLS_SUFFIX].max()), counters=counters, **entries)


class KeyedEntries:
    """The saved layout of a dynamic table (module docstring). ``held``: the (rect,
    variable) pairs of the table this rank holds (``checkpoint.pieces.layer_pieces``).

    Example::

        from tfhybrid.dynamic.saved import KEYED_ENTRIES
        assert KEYED_ENTRIES.saves_row_state
    """

    # its accumulator is saved with its entries, not as an optimizer slot
    saves_row_state = True

    def checkpoint_saveable(self, layer: Any, t: int, held: list) -> Callable:
        """A saveable factory (``_gather_saveables_for_checkpoint``) of table ``t``."""
        mesh = layer.mesh
        return lambda name: _KeyedSaveable(name, layer.table_specs[t], _held_tables(held),
                                           mesh.model_position, mesh.model_parallel)

    @staticmethod
    def weights_file_keys(t: int) -> list[str]:
        """The keys a weights file holds for table ``t`` besides ``table_<t>`` (its rows
        in the saving mesh's slot order)."""
        return [f"table_{t}{suffix}" for suffix in SUFFIXES]

    def save_to_weights_file(self, layer: Any, t: int, held: list, store: Any,
                             contributes: bool, all_sum: Callable) -> None:
        """Writes table ``t``'s per-slot state beside its rows, as a checkpoint holds it;
        ``contributes``: this rank adds its shards' parts (each once over the
        replicas); ``all_sum`` sums an array over every rank (a collective)."""
        spec = layer.table_specs[t]
        positions, position = layer.mesh.model_parallel, layer.mesh.model_position
        tables = _held_tables(held)
        per_slot = [(s, a) for s, a, _ in SLOT_STATE + CANDIDATES]
        for suffix, attribute in per_slot:
            free = -1 if suffix.endswith("_seen") else 0
            whole = np.zeros([spec.rows], np.float64 if suffix == "_accumulator"
                             else np.int64)
            if contributes:
                for rect, table in tables:
                    values = getattr(table, attribute).numpy()
                    if len(values) != rect.row_end - rect.row_start:   # no candidates
                        values = np.full([rect.row_end - rect.row_start], free)
                    whole[rect.row_start:rect.row_end] = values - free
            # every slot comes from one rank: the sum holds it, less ``free``
            whole = all_sum(whole, f"tfhybrid_weights_file_{t}{suffix}") + free
            store[f"table_{t}{suffix}"] = whole.astype(
                np.float32 if suffix == "_accumulator" else np.int64)
        calls = np.zeros([positions], np.int64)
        counters = np.zeros([positions, len(COUNTERS)], np.int64)
        if contributes:
            for _, table in tables:
                calls[position] = int(table.calls.numpy())
                counters[position] = table.counters.numpy()
        for suffix, values in ((CALLS_SUFFIX, calls), (COUNTERS_SUFFIX, counters)):
            store[f"table_{t}{suffix}"] = all_sum(values, f"tfhybrid_weights_file_{t}{suffix}")

    def load_layout_from_weights_file(self, layer: Any, t: int, held: list,
                                      store: Any) -> None:
        """Nothing before the values: a dynamic table is loaded whole by key after."""
        del layer, t, held, store

    def load_state_from_weights_file(self, layer: Any, t: int, held: list,
                                     store: Any) -> None:
        """Loads table ``t`` by key from the weights file (module docstring)."""
        spec = layer.table_specs[t]
        saved = {suffix: np.asarray(store[f"table_{t}{suffix}"])
                 for suffix in ("",) + SUFFIXES}
        if saved[""].ndim != 2 or saved[""].shape[1] != spec.dim:
            raise ValueError(f"the weights file holds dynamic table {spec.name!r} with rows "
                             f"of shape {saved[''].shape}; this table has dim {spec.dim}")
        if spec.keyed.admit_after == 1:
            for suffix, _, _ in CANDIDATES:
                saved.pop(suffix)
        load_by_key(saved, [table for _, table in _held_tables(held)],
                    layer.mesh.model_position, layer.mesh.model_parallel)

    @staticmethod
    def slot_shape(spec: Any) -> tuple[int, int]:
        return (spec.rows, 1)

    @staticmethod
    def slot_rect(spec: Any, rect: resharding.Rect) -> resharding.Rect:
        return resharding.Rect(rect.row_start, rect.row_end, 0, 1)


# the one instance the storage kinds register
KEYED_ENTRIES = KeyedEntries()
