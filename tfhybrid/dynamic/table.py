"""A dynamic table's shard: open-world keys in a fixed number of slots.

``DynamicTable`` keeps ``capacity`` rows (``rows``, ``[capacity, dim]``, what the
optimizer trains) and row-wise AdaGrad's accumulator per slot, which it keeps itself: a
slot that takes a new key starts again from the key's initial row
(``tfhybrid.dynamic.initial_rows``) and a zero accumulator, so an evicted row's
optimizer state goes with it. Which key a slot holds, when it was last seen, how often,
the admission candidates and the counters are variables too, updated by one C++ op per
call (``DynamicFindOrInsert``, ``tfhybrid/custom_ops/cc/kernels/dynamic_table_kernels.cc``:
its rules of admission, eviction and expiry are written there). Its result depends only
on the table's state and the call's keys, so replicas of a shard called with the same
keys stay identical, slot for slot.

A key that has no slot (not admitted yet, or refused by a full table with
``evict=None``) reads zeros and trains nothing.

Example::

    import tensorflow as tf
    from tfhybrid.dynamic.table import DynamicTable
    table = DynamicTable(capacity=4, dim=2, initializer="ones", admit_after=2)
    assert table.slots(tf.constant([10, 11, 10], tf.int64)).numpy().tolist() == [0, -1, 0]
    assert table.stats()["size"] == 1
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import custom_ops
from tfhybrid import roles
from tfhybrid import slot_owners
from tfhybrid.combiners import COMBINERS, combined_bags, kept_in_bags
from tfhybrid.dynamic import fallback
from tfhybrid.dynamic.initial_rows import KeyedInitializer
from tfhybrid.fiited import checked_int
from tfhybrid.optimizer_traits import Trains, trains_of

EVICTION = ("lfu", "lru", None)
# the counters' order in their variable (dynamic_table_kernels.cc's Counter)
COUNTERS = ("admissions", "evictions", "refusals", "hits", "misses", "size", "next_fresh",
            "candidates")
# the variables DynamicFindOrInsert updates, in its inputs' order
STATE = ("slot_keys", "slot_seen", "slot_count", "index", "cand_keys", "cand_seen",
         "cand_count", "cand_index", "counters")


def table_of(variable: Any) -> "DynamicTable | None":
    """The DynamicTable whose rows ``variable`` is, else None."""
    table = roles.role_of(variable).table
    return table if isinstance(table, DynamicTable) else None


def _refuse_other_optimizers(optimizer: Any, variable: Any, slot_name: Any) -> None:
    """The slot guard of ``_tf_internals``: an optimizer the table is not trained by is
    refused by name when it is built with a dynamic table's rows or makes a slot for
    them (a slot per entry would outlive the entry's key)."""
    table = table_of(variable)
    if table is None:
        return
    owner = slot_owners.slot_owner(optimizer, variable)
    trains = trains_of(owner)
    # tf-keras' SGD makes a momentum slot even with momentum 0: it carries nothing
    if (slot_name is None and trains in table.trained_by) or trains is Trains.NO_STATE:
        return
    raise ValueError(
        f"{type(owner).__name__} cannot train dynamic table {table.name!r}: its rows change "
        "keys as keys are admitted and evicted, and a slot per entry would outlive its key; "
        "train it with tfhybrid.optimizers.RowWiseAdagrad or MomentumScaledRowWiseAdagrad "
        "(their state is the table's own) or SGD without momentum")


def checked_default_row(default_row: Any, dim: int) -> tuple[float, ...] | None:
    """``default_row`` (None: zeros; a number; ``dim`` numbers) as ``dim`` floats, or
    None for zeros; ``ValueError`` names any other value."""
    if default_row is None:
        return None
    values = np.asarray(default_row, np.float64)
    if values.ndim == 0:
        values = np.full([dim], float(values))
    if values.shape != (dim,) or not np.all(np.isfinite(values)):
        raise ValueError(f"default_row={default_row!r} must be None, a number or {dim} "
                         "finite numbers (the row a key without a slot reads)")
    return tuple(float(v) for v in values)


def _buckets(entries: int) -> int:
    """The index's buckets for ``entries``: a power of two, at least twice as many."""
    return 1 << max(1, (2 * entries - 1).bit_length())


class DynamicTable(tf.Module):
    """``capacity`` slots of ``dim`` float32 entries for open-world int64 keys (module
    docstring). ``admit_after``: sightings before a key gets a slot; ``evict``: ``"lfu"``,
    ``"lru"`` or None (a full table refuses new keys); ``ttl_steps``: free rows unseen
    for that many calls; ``pinned_calls``: rows seen in the last that many calls are
    never evicted (2 when a pipeline looks up a batch ahead). ``use_custom_op``: None
    runs the C++ op where the library is loaded, else its NumPy twin
    (``tfhybrid.dynamic.fallback``); True requires the op, False takes the twin.
    ``add_weight``: the holding Keras layer's, whose weights the variables then are.

    Example::

        import tensorflow as tf
        from tfhybrid.dynamic.table import DynamicTable
        table = DynamicTable(capacity=2, dim=3, initializer=0.5)
        slots = table.slots(tf.constant([7, -7, 7], tf.int64))
        rows = table.lookup(slots, tf.constant([2, 1], tf.int64))
        assert rows.numpy().tolist() == [[1.0] * 3, [0.5] * 3]
    """

    # only a row-wise optimizer (its state is the table's own, reset with each new key)
    # or one that keeps nothing: a slot per entry would outlive the slot's key
    trained_by = frozenset({Trains.ROW_STATE, Trains.NO_STATE})

    def __init__(self, capacity: int, dim: int, *, initializer: Any = "uniform",
                 seed: int = 0, admit_after: int = 1, evict: str | None = "lfu",
                 ttl_steps: int | None = None, pinned_calls: int = 1,
                 use_custom_op: bool | None = None, name: str | None = None,
                 add_weight: Callable[..., Any] | None = None,
                 default_row: Any = None):
        _tf_internals.install_autograph_rule()
        super().__init__(name=name)
        self.capacity = checked_int("capacity", capacity, 1)
        if self.capacity >= 2 ** 31:
            raise ValueError(f"capacity={capacity} must be below 2**31 per shard")
        self.dim = checked_int("dim", dim, 1)
        self.admit_after = checked_int("admit_after", admit_after, 1)
        if evict not in EVICTION:
            raise ValueError(f"evict={evict!r} is unknown; expected one of {EVICTION}")
        self.evict = evict
        self.ttl_steps = None if ttl_steps is None else checked_int("ttl_steps", ttl_steps, 1)
        self.pinned_calls = checked_int("pinned_calls", pinned_calls, 1)
        if use_custom_op not in (None, True, False):
            raise ValueError(f"use_custom_op={use_custom_op!r}; expected None, True or False")
        if use_custom_op:
            custom_ops.require_library()
        self.use_custom_op = use_custom_op
        self.initializer = KeyedInitializer.of(initializer, seed)
        self.default_row = checked_default_row(default_row, self.dim)
        candidates = self.capacity if self.admit_after > 1 else 1
        variable = functools.partial(_tf_internals.table_variable, add_weight,
                                     table=self.name, name_scope=True, trainable=False)
        self.rows = _tf_internals.table_variable(
            add_weight, lambda: tf.zeros([self.capacity, self.dim]), table=self.name,
            name_scope=True, name="rows")
        self.accumulator = variable(lambda: tf.zeros([self.capacity]), name="accumulator")
        self.slot_keys = variable(lambda: tf.zeros([self.capacity], tf.int64),
                                  name="slot_keys")
        self.slot_seen = variable(lambda: tf.fill([self.capacity], tf.constant(-1, tf.int64)),
                                  name="slot_seen")
        # sightings, saturating at 2**31 - 1 (the kernel's KeyArrays say why)
        self.slot_count = variable(lambda: tf.zeros([self.capacity], tf.int32),
                                   name="slot_count")
        self.index = variable(lambda: tf.fill([_buckets(self.capacity)], -1), name="index")
        self.cand_keys = variable(lambda: tf.zeros([candidates], tf.int64), name="cand_keys")
        self.cand_seen = variable(lambda: tf.fill([candidates], tf.constant(-1, tf.int64)),
                                  name="cand_seen")
        self.cand_count = variable(lambda: tf.zeros([candidates], tf.int32),
                                   name="cand_count")
        self.cand_index = variable(lambda: tf.fill([_buckets(candidates)], -1),
                                   name="cand_index")
        self.counters = variable(lambda: tf.zeros([len(COUNTERS)], tf.int64),
                                 name="counters")
        self.calls = variable(lambda: tf.zeros([], tf.int64), name="calls")
        # how an optimizer finds the rows' accumulator (row_accumulator: the table's own,
        # reset with each new key) and a kind's guard the table (table)
        roles.assign(self.rows, table=self, row_accumulator=self.accumulator)
        _tf_internals.install_slot_guard(_refuse_other_optimizers)

    @property
    def row_state(self) -> tuple:
        """The variables kept per slot besides the rows, which live, are broadcast and
        are checkpointed where the shard is."""
        return (self.accumulator, self.slot_keys, self.slot_seen, self.slot_count,
                self.index, self.cand_keys, self.cand_seen, self.cand_count,
                self.cand_index, self.counters, self.calls)

    def slots(self, keys: tf.Tensor, insert: bool = True) -> tf.Tensor:
        """The slot of each int64 key (-1 where it has none), admitting, evicting and
        expiring as the table's rules say; new slots get their keys' initial rows and a
        zero accumulator. One call per step: it counts as one call of ``ttl_steps`` and
        ``pinned_calls``. ``insert=False`` (inference) only finds, changing nothing."""
        keys = tf.convert_to_tensor(keys)
        if keys.dtype != tf.int64:
            raise ValueError(f"DynamicTable {self.name!r}: keys must be int64, got "
                             f"{keys.dtype.name}")
        flat = tf.reshape(keys, [-1])
        if not insert:
            found, _, _ = self._find_or_insert(flat, self.calls.read_value(), insert=False)
            return tf.reshape(found, tf.shape(keys))
        slots, new_slots, new_keys = self._find_or_insert(flat, self.calls.assign_add(1),
                                                          insert=True)
        if self._uses_op():
            # the op wrote the new slots' rows and zero accumulators itself
            return tf.reshape(slots, tf.shape(keys))
        fresh = self.initializer.rows(new_keys, self.dim, use_custom_op=False)
        written = [self.rows.scatter_update(tf.IndexedSlices(fresh, new_slots)),
                   self.accumulator.scatter_update(tf.IndexedSlices(
                       tf.zeros(tf.shape(new_slots), tf.float32), new_slots))]
        with tf.control_dependencies(written):
            return tf.reshape(tf.identity(slots), tf.shape(keys))

    def _uses_op(self) -> bool:
        """Whether calls run the C++ op (else its NumPy twin and TensorFlow's ops)."""
        return self.use_custom_op is not False and custom_ops.custom_ops_available()

    def _find_or_insert(self, keys: tf.Tensor, call: tf.Tensor, insert: bool):
        """One call of DynamicFindOrInsert: the C++ op, or its NumPy twin."""
        rules = dict(admit_after=self.admit_after, evict=self.evict or "none",
                     ttl=self.ttl_steps or 0, pinned=self.pinned_calls, insert=insert)
        if self._uses_op():
            return custom_ops.dynamic_find_or_insert(self, keys, call, **rules)
        state = [getattr(self, name) for name in STATE]

        def run(keys, call, *values):
            arrays = {name: np.array(v) for name, v in zip(STATE, values)}
            found = fallback.find_or_insert(arrays, keys, int(call), **rules)
            return list(found) + [arrays[name] for name in STATE]

        out = tf.numpy_function(run, [keys, call] + [v.read_value() for v in state],
                                [tf.int32, tf.int32, tf.int64] + [v.dtype for v in state],
                                stateful=True)
        written = [v.assign(value) for v, value in zip(state, out[3:])] if insert else []
        with tf.control_dependencies(written):
            slots = tf.identity(out[0])
        slots.set_shape(keys.shape)
        return slots, tf.reshape(out[1], [-1]), tf.reshape(out[2], [-1])

    def lookup(self, slots: tf.Tensor, lengths: tf.Tensor, combiner: str = "sum",
               weights: tf.Tensor | None = None) -> tf.Tensor:
        """[bags, dim]: each bag's rows at ``slots`` (``lengths`` per bag) combined by
        ``combiner`` (``tfhybrid.combiners``: over all of the bag's keys), each times its
        weight where ``weights`` (one per slot) are given; a slot of -1 reads the default
        row (zeros unless given) and takes no gradient. The fused C++ lookup where the op
        library is loaded (and ``use_custom_op`` allows), its gradient rows at the
        slots."""
        if combiner not in COMBINERS:
            raise ValueError(f"combiner={combiner!r} is unknown; expected one of {COMBINERS}")
        slots = tf.reshape(tf.convert_to_tensor(slots), [-1])
        lengths = tf.cast(tf.reshape(lengths, [-1]), tf.int64)
        use_op = None if self.use_custom_op is not False else False
        held_weights = None
        if weights is not None:
            weights = tf.reshape(tf.cast(weights, tf.float32), [-1])
            held, held_per_bag, held_weights = kept_in_bags(slots, lengths, slots >= 0,
                                                            weights)
        elif use_op is not False and custom_ops.custom_ops_available():
            held, held_per_bag = custom_ops.dynamic_held_slots(slots, lengths)
        else:
            held, held_per_bag = kept_in_bags(slots, lengths, slots >= 0)
        sums = custom_ops.embedding_lookup_combine(
            _tf_internals.tf_variable(self.rows),
            tf.RaggedTensor.from_row_lengths(held, held_per_bag, validate=False),
            combiner="sum", table_name=self.name, use_custom_op=use_op,
            weights=None if held_weights is None else tf.RaggedTensor.from_row_lengths(
                held_weights, held_per_bag, validate=False))
        if self.default_row is not None:
            # each key without a slot reads the default row (a constant: no gradient),
            # times its weight
            if weights is None:
                unheld = tf.cast(lengths - held_per_bag, tf.float32)
            else:
                bags = tf.ragged.row_splits_to_segment_ids(
                    tf.concat([[0], tf.cumsum(lengths)], 0))
                unheld = tf.math.unsorted_segment_sum(
                    tf.where(slots >= 0, 0.0, weights), bags, tf.size(lengths))
            sums = sums + unheld[:, None] * tf.constant(self.default_row, tf.float32)[None]
        return combined_bags(sums, combiner, lengths, weights)

    def stats(self) -> dict[str, int]:
        """Its counters: rows held (``size``) of ``capacity``, admissions, evictions
        (expiries included), refusals, hits and misses (sightings), candidates."""
        values = self.counters.numpy().tolist()
        found = {name: int(v) for name, v in zip(COUNTERS, values) if name != "next_fresh"}
        found["capacity"] = self.capacity
        looked = found["hits"] + found["misses"]
        found["hit_rate"] = found["hits"] / looked if looked else 0.0
        return found

    def load_entries(self, keys: np.ndarray, rows: np.ndarray, accumulator: np.ndarray,
                     seen: np.ndarray, count: np.ndarray, candidates: dict | None,
                     calls: int, counters: np.ndarray) -> None:
        """Replaces the table's state by these entries (a restore by key): the keys take
        slots 0, 1, ... in key order, with their rows, accumulators, last calls and
        sightings; ``candidates`` (``keys``, ``seen``, ``count``) are the admission
        candidates (the most recently seen kept if there are more than fit); ``calls``
        the calls so far; ``counters`` the cumulative counters (admissions, evictions,
        refusals, hits, misses). ``ValueError`` names the keys and the capacity when
        they do not fit."""
        keys = np.asarray(keys, np.int64)
        if len(keys) > self.capacity:
            raise ValueError(
                f"dynamic table {self.name!r}: {len(keys)} keys are to be restored into "
                f"this shard, which has capacity {self.capacity}; restore onto a mesh and "
                "capacity whose shards hold them (capacity >= keys per shard)")
        order = np.argsort(keys, kind="stable")
        n = len(keys)

        def padded(values, fill, dtype, width=None):
            shape = [self.capacity] + ([] if width is None else [width])
            out = np.full(shape, fill, dtype)
            out[:n] = np.asarray(values, dtype)[order]
            return out

        self.rows.assign(padded(rows, 0.0, np.float32, self.dim))
        self.accumulator.assign(padded(accumulator, 0.0, np.float32))
        self.slot_keys.assign(padded(keys, 0, np.int64))
        self.slot_seen.assign(padded(seen, -1, np.int64))
        self.slot_count.assign(padded(np.minimum(count, 2**31 - 1), 0, np.int32))
        self.index.assign(fallback.index_of(keys[order], self.index.shape[0]))
        held = 0
        if self.admit_after > 1 and candidates is not None:
            cand = {k: np.asarray(v, np.int64) for k, v in candidates.items()}
            keep = np.lexsort((cand["keys"], -cand["seen"]))[:self.cand_keys.shape[0]]
            keep = keep[np.argsort(cand["keys"][keep], kind="stable")]
            size = self.cand_keys.shape[0]
            held = len(keep)
            for name, fill in (("keys", 0), ("seen", -1), ("count", 0)):
                dtype = np.int32 if name == "count" else np.int64
                values = np.full([size], fill, dtype)
                values[:held] = np.minimum(cand[name][keep], np.iinfo(dtype).max)
                getattr(self, f"cand_{name}").assign(values)
            self.cand_index.assign(fallback.index_of(cand["keys"][keep],
                                                     self.cand_index.shape[0]))
        values = np.zeros([len(COUNTERS)], np.int64)
        for i, name in enumerate(COUNTERS):
            if name in ("admissions", "evictions", "refusals", "hits", "misses"):
                values[i] = counters[i]
        values[COUNTERS.index("size")] = n
        values[COUNTERS.index("next_fresh")] = n
        values[COUNTERS.index("candidates")] = held
        self.counters.assign(values)
        self.calls.assign(calls)

    def held_keys(self) -> np.ndarray:
        """The keys that have a slot, in slot order."""
        return self.slot_keys.numpy()[self.slot_seen.numpy() >= 0]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of its variables: the rows, the per-slot state and the index."""
        def nbytes(variable):
            return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size
        rows = nbytes(self.rows)
        state = sum(nbytes(v) for v in self.row_state)
        return {"rows": rows, "state": state, "total": rows + state}
