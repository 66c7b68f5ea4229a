"""``CachedTable``: ``rows`` x ``dim`` float32 rows in a memory-mapped file behind a
DRAM cache of ``cache_rows`` rows; the package docstring describes the store, the cache,
the index and weight-sync mode."""

from __future__ import annotations

import functools
import gc
import os
import weakref
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import roles
from tfhybrid import slot_owners
from tfhybrid.fiited import checked_int
from tfhybrid.optimizer_traits import Trains, trains_of

POLICIES = ("lru", "lfu")
# rows initialized (or written by write_rows) per block: bounds the memory a table of
# any size needs on the way into its store
_BLOCK_BYTES = 8 * 1024 * 1024


# each live table's store file: two tables writing one file would corrupt each other
_OPEN_STORES: "weakref.WeakValueDictionary[str, CachedTable]" = weakref.WeakValueDictionary()


def table_of(variable: Any) -> "CachedTable | None":
    """The CachedTable whose cache ``variable`` is, else None."""
    table = roles.role_of(variable).table
    return table if isinstance(table, CachedTable) else None


def accumulator_table_of(variable: Any) -> "CachedTable | None":
    """The CachedTable whose ``cache_accumulator`` ``variable`` is, else None."""
    return roles.role_of(variable).state_outside


def _refuse_cache_slots(optimizer: Any, variable: Any, slot_name: Any) -> None:
    """A Keras optimizer's slot for a tiered table's cache is refused (the slot guard of
    ``_tf_internals``): a slot per cache entry would stay put while rows move between
    the cache and the file. ``slot_name`` None: ``optimizer`` is being built with
    ``variable`` (Keras 3, whose SGD makes no slot): only an optimizer that updates the
    chunks each row holds may train a FIITED table's cache."""
    table = table_of(variable)
    if table is None:
        return
    if slot_name is None:
        # built with a plain tier's cache, any optimizer passes here (one that keeps a
        # slot per entry is refused when it makes the slot, which names it); a FIITED
        # tier's, only one it is trained by
        if not getattr(table, "chunks", None) or trains_of(
                slot_owners.slot_owner(optimizer, variable)) in table.trained_by:
            return
    if getattr(table, "chunks", None):
        raise ValueError(
            f"{type(optimizer).__name__} would update every entry of table "
            f"{table.name!r}, whose rows keep FIITED chunk prefixes (dims='adaptive') in a "
            "DRAM cache (cache_rows): train it with tfhybrid.optimizers.RowWiseAdagrad, "
            "which updates the chunks each row holds")
    if trains_of(optimizer) is not Trains.NO_STATE:
        raise ValueError(
            f"{type(optimizer).__name__} keeps a {slot_name!r} slot per entry of table "
            f"{table.name!r}, whose rows move between a DRAM cache and its file "
            "(cache_rows): train it with tfhybrid.optimizers.RowWiseAdagrad (its row "
            "state moves with the rows) or SGD without momentum")


class CachedTable(tf.Module):
    """``rows`` x ``dim`` float32 rows on disk behind a cache of ``cache_rows`` rows.

    ``initializer(start, stop)`` gives rows ``start..stop-1`` as a ``[stop - start, dim]``
    array (default: uniform in [-0.05, 0.05) from ``seed``, drawn per block so a table
    larger than memory never exists whole); ``policy`` is ``"lru"`` or ``"lfu"``;
    ``add_weight``: the ``add_weight`` of the Keras layer that holds the table, whose
    weights the cache and its state then are (Keras 3 tracks and trains only those).

    Example::

        import tempfile
        import tensorflow as tf
        from tfhybrid.tiers import CachedTable
        table = CachedTable(1000, 4, cache_rows=8, directory=tempfile.mkdtemp(), seed=0)
        slots = table.slots(tf.constant([[3, 7], [3, 999]]))   # ids -> cache slots
        rows = tf.gather(table.cache, slots)                   # [2, 2, 4]
        assert (rows.numpy()[1, 1] == table.read_rows(999, 1000)[0]).all()
        assert table.stats()["misses"] == 3
    """

    # what can train it: a row-wise optimizer (its row state moves with the rows) or
    # one that keeps nothing; a slot per entry would stay put while rows move
    trained_by = frozenset({Trains.ROW_STATE, Trains.NO_STATE})

    def __init__(self, rows: int, dim: int, cache_rows: int, directory: str, *,
                 initializer: Callable[[int, int], Any] | None = None,
                 seed: int | None = None, policy: str = "lru", name: str | None = None,
                 pinned_calls: int = 1, add_weight: Callable[..., Any] | None = None):
        _tf_internals.install_autograph_rule()
        super().__init__(name=name)
        # optimizers refuse slots for the cache from now on (no slot exists before a
        # table does)
        _tf_internals.install_slot_guard(_refuse_cache_slots)
        # the calls of slots() whose rows are never evicted: 1, the call itself; 2, also
        # the call before (a pipeline loads a batch's rows while the step of the batch
        # before, loaded by the previous call, still runs on its slots)
        self.pinned_calls = checked_int("pinned_calls", pinned_calls, 1)
        self.rows = checked_int("rows", rows, 1)
        self.dim = checked_int("dim", dim, 1)
        self.cache_rows = checked_int("cache_rows", cache_rows, 1)
        if self.cache_rows > self.rows:
            raise ValueError(f"cache_rows={cache_rows} exceeds rows={rows}: the whole "
                             "table fits, keep it in memory")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is unknown; expected one of {POLICIES}")
        self.policy = policy
        if not isinstance(directory, (str, os.PathLike)) or not os.path.isdir(directory):
            raise ValueError(f"directory={directory!r} must be an existing folder for the "
                             "table's store")
        stem = os.path.join(os.fspath(directory), self.name)
        self.paths = (f"{stem}.values", f"{stem}.accumulator")
        holder = _OPEN_STORES.get(os.path.realpath(self.paths[0]))
        if holder is not None:
            del holder
            gc.collect()   # a model that is gone may still wait for the cycle collector
            holder = _OPEN_STORES.get(os.path.realpath(self.paths[0]))
        if holder is not None:
            raise ValueError(f"CachedTable {self.name!r}: {self.paths[0]} is the store of "
                             f"another live table ({holder.name!r}); give the table another "
                             "name or another directory")
        _OPEN_STORES[os.path.realpath(self.paths[0])] = self
        self.store = np.memmap(self.paths[0], np.dtype("<f4"), "w+",
                               shape=(self.rows, self.dim))
        self.store_accumulator = np.memmap(self.paths[1], np.dtype("<f4"), "w+",
                                           shape=(self.rows,))
        # named after the table: gradient syncs name their collectives by variable name;
        # made through the holding layer's add_weight: Keras 3 trains only its weights
        variable = functools.partial(_tf_internals.table_variable, add_weight,
                                     table=self.name, name_scope=True)
        self.cache = variable(lambda: tf.zeros([self.cache_rows, self.dim]), name="cache")
        self.cache_accumulator = variable(lambda: tf.zeros([self.cache_rows]),
                                          trainable=False, name="cache_accumulator")
        # how an optimizer finds the table of a cache gradient (table_of) and where each
        # row's accumulator lives (row_accumulator: it moves with the row), and a
        # checkpoint the table of an accumulator (accumulator_table_of)
        roles.assign(self.cache, table=self, row_accumulator=self.cache_accumulator,
                     rows_outside=self)
        roles.assign(self.cache_accumulator, state_outside=self)
        self._slot_of_row = np.full(self.rows, -1, np.int32)   # 4 bytes per row
        self._row_of_slot = np.full(self.cache_rows, -1, np.int64)
        self._stamp = np.zeros(self.cache_rows, np.int64)      # LFU: steps used since loaded
        self._referenced = np.zeros(self.cache_rows, bool)     # LRU (CLOCK): used since passed
        self._hand = 0                                         # LRU (CLOCK): the next slot
        self._last_used = np.zeros(self.cache_rows, np.int64)  # step of the last lookup
        self._used = np.zeros(self.cache_rows, bool)   # may differ from the store
        self._filled = 0                               # slots [filled, cache_rows) free
        # weight-sync mode: the rows written back since the replicas were last averaged
        self._written_since_sync: list[np.ndarray] = []
        if initializer is None:
            base = 0 if seed is None else int(seed)

            def initializer(start, stop):
                return tf.random.stateless_uniform(
                    [stop - start, self.dim], seed=[base, start], minval=-0.05,
                    maxval=0.05).numpy()
        # drawn eagerly, also when the table is made while a function is traced (Keras 3
        # builds a layer inside the trace of its first call)
        with tf.init_scope():
            for start, stop in self.blocks():
                self.write_rows(start, initializer(start, stop))
        self._step = 0
        self._hits = self._misses = self._writebacks = self._synced_rows = 0

    def blocks(self):
        """(start, stop) row ranges of about 8 MiB: how whole tables move through memory."""
        step = max(1, _BLOCK_BYTES // (4 * self.dim))
        for start in range(0, self.rows, step):
            yield start, min(self.rows, start + step)

    # ------------------------------------------------------------------ the cache
    def slots(self, ids: Any) -> Any:
        """The cache slot of every id (a tensor, ``tf.RaggedTensor`` or
        ``tf.SparseTensor`` of the same structure, int64), loading the rows that are not
        cached first. Every id of one call is cached at once, so a call may name at most
        ``cache_rows`` distinct ids. Works eagerly and inside ``tf.function`` (the host
        side runs in a ``tf.py_function``, ordered with the step's other stateful ops)."""
        if isinstance(ids, tf.RaggedTensor):
            return ids.with_flat_values(self.slots(ids.flat_values))
        if isinstance(ids, tf.SparseTensor):
            return tf.SparseTensor(ids.indices, self.slots(ids.values), ids.dense_shape)
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise ValueError(f"CachedTable {self.name!r}: ids must be integers, got "
                             f"{ids.dtype}")
        # A call may evict the rows of the calls before it but the pinned ones, so with
        # pinned_calls=1 its loads wait for every earlier use of the cache in the function
        # being traced (Keras 3 unrolls several predict steps into one): the handles of
        # what the host side writes make it a write of them, which TF orders after the
        # earlier reads and writes. A pipeline (more pinned calls) loads the next batch's
        # rows while the step before still runs on its own.
        written = ([variable.handle for variable in self._host_written()]
                   if self.pinned_calls == 1 else [])
        slots = tf.py_function(lambda ids, *_: self._slots_numpy(ids), [ids] + written,
                               tf.int64, name=f"{self.name}_cache_slots")
        slots.set_shape(ids.shape)
        return slots

    def _host_written(self) -> tuple:
        """The variables that loading rows into the cache writes."""
        return (self.cache, self.cache_accumulator)

    def _slots_numpy(self, ids: tf.Tensor) -> np.ndarray:
        ids = ids.numpy()
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            bad = flat.min() if flat.min() < 0 else flat.max()
            raise ValueError(f"CachedTable {self.name!r} got id {bad}, expected ids in "
                             f"[0, {self.rows})")
        self._step += 1
        self._pinned_since = self._step - self.pinned_calls + 1
        slots = self._slot_of_row[flat].astype(np.int64)
        missing = slots < 0
        hit_slots = slots[~missing]
        # this batch's cached rows: never evicted for its other rows
        self._last_used[hit_slots] = self._step
        hits = int(np.count_nonzero(self._last_used[:self._filled] == self._step))
        missing_ids = flat[missing]
        if missing_ids.size:
            rows = np.unique(missing_ids)   # ascending: the store is read in file order
            held = int(np.count_nonzero(self._last_used[:self._filled]
                                        >= self._pinned_since)) - hits
            if hits + held + rows.size > self.cache_rows:
                before = (f" and the call before holds {held} more rows (pinned_calls="
                          f"{self.pinned_calls})" if self.pinned_calls > 1 else "")
                raise ValueError(
                    f"CachedTable {self.name!r}: one batch names {hits + rows.size} "
                    f"distinct ids{before} but the cache holds cache_rows="
                    f"{self.cache_rows}; raise cache_rows or lower the batch")
            self._load(rows)
            self._misses += rows.size
            slots[missing] = self._slot_of_row[missing_ids]
        self._hits += hits
        used = slots if missing_ids.size else hit_slots
        if self.policy == "lru":
            self._referenced[used] = True
        else:                              # once per step and slot, as fancy += does
            self._stamp[used] += 1
        self._last_used[used] = self._step
        self._used[used] = True
        return slots.reshape(ids.shape)

    def _load(self, rows: np.ndarray) -> None:
        """Puts ``rows`` (ascending, none cached) into slots this batch does not use:
        free slots first, then the policy's least-recently / least-frequently used ones,
        written back first if used since loaded."""
        free = min(rows.size, self.cache_rows - self._filled)
        victims = np.arange(self._filled, self._filled + free)
        self._filled += free
        self._last_used[victims] = self._step   # taken: not to be taken twice
        need = rows.size - free
        if need:
            taken = self._clock(need) if self.policy == "lru" else self._least_used(need)
            self._write_back(taken)
            old = self._row_of_slot[taken]
            self._slot_of_row[old] = -1
            victims = np.concatenate([victims, taken])
        self.cache.scatter_update(tf.IndexedSlices(np.asarray(self.store[rows]), victims))
        self.cache_accumulator.scatter_update(
            tf.IndexedSlices(np.asarray(self.store_accumulator[rows]), victims))
        self._row_of_slot[victims] = rows
        self._slot_of_row[rows] = victims
        self._stamp[victims] = 0
        self._referenced[victims] = False
        self._used[victims] = False

    def _clock(self, need: int) -> np.ndarray:
        """``need`` slots not used by this batch, by CLOCK (second chance), the usual
        approximation of LRU at O(rows loaded) per batch: a hand sweeps the slots and
        takes each one not used since the hand last passed it."""
        taken = []
        while need:
            window = (self._hand + np.arange(min(self.cache_rows, max(2 * need, 256)))) \
                % self.cache_rows
            takeable = ~self._referenced[window] & (self._last_used[window]
                                                    < self._pinned_since)
            picks = np.flatnonzero(takeable)[:need]
            passed = picks[-1] + 1 if picks.size == need else window.size
            self._referenced[window[:passed]] = False   # their second chance is spent
            self._last_used[window[picks]] = self._step    # not to be taken twice
            taken.append(window[picks])
            need -= picks.size
            self._hand = (self._hand + passed) % self.cache_rows
        return np.concatenate(taken)

    def _least_used(self, need: int) -> np.ndarray:
        """``need`` slots not used by this batch, the least frequently used (LFU)."""
        score = self._stamp.copy()
        score[self._last_used >= self._pinned_since] = np.iinfo(np.int64).max
        return np.argpartition(score, need - 1)[:need]

    def _write_back(self, slots: np.ndarray) -> None:
        """Writes the rows of ``slots`` that were used since loaded to the store."""
        slots = slots[(self._row_of_slot[slots] >= 0) & self._used[slots]]
        if not slots.size:
            return
        rows = self._row_of_slot[slots]
        order = np.argsort(rows)
        slots, rows = slots[order], rows[order]
        self.store[rows] = tf.gather(self.cache, slots).numpy()
        self.store_accumulator[rows] = tf.gather(self.cache_accumulator, slots).numpy()
        self._used[slots] = False
        self._writebacks += slots.size
        self._written_since_sync.append(rows)

    def flush(self) -> None:
        """Writes every cached row that was used since loaded back to the store (the
        cache keeps it): after it, the store alone is the table."""
        self._write_back(np.arange(self.cache_rows))
        self.store.flush()
        self.store_accumulator.flush()

    def invalidate(self) -> None:
        """Empties the cache without writing back (the store was replaced)."""
        self._slot_of_row[:] = -1
        self._row_of_slot[:] = -1
        self._stamp[:] = 0
        self._referenced[:] = False
        self._hand = 0
        self._last_used[:] = 0
        self._used[:] = False
        self._filled = 0
        self._written_since_sync = []

    # ------------------------------------------------------------ weight sync
    def sync_replicas(self, average: Callable[[list], list]) -> tf.Tensor:
        """Averages the store rows the replicas may disagree on: those written back since
        the last call. The cache is averaged with the other weights; a row written back
        and cached again is averaged in both places, as its store copy is what remains
        if it leaves the cache unused (after a checkpoint's flush).

        ``average`` maps ``[values [n, dim], accumulators [n]]`` to their means over the
        shard's data group. Every replica wrote back the same rows (their caches choose
        alike), so all send the same n. Returns the rows' count, once they are written;
        eagerly or inside a ``tf.function`` (run it after the step's update)."""
        rows, values, accumulator = tf.py_function(
            self._take_rows_to_sync, [], [tf.int64, tf.float32, tf.float32],
            name=f"{self.name}_read_rows_to_sync")
        rows.set_shape([None])
        values.set_shape([None, self.dim])
        accumulator.set_shape([None])
        values, accumulator = average([values, accumulator])

        def write(r, v, a):
            r = r.numpy()
            self.store[r] = v.numpy()
            self.store_accumulator[r] = a.numpy()
            return np.int64(r.size)
        written = tf.py_function(write, [rows, values, accumulator], tf.int64,
                                 name=f"{self.name}_write_synced_rows")
        written.set_shape([])
        return written

    def _take_rows_to_sync(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows written back since the last sync (ascending), their values and
        accumulators in the store; the next sync starts a new list."""
        rows = (np.unique(np.concatenate(self._written_since_sync))
                if self._written_since_sync else np.zeros([0], np.int64)).astype(np.int64)
        self._written_since_sync = []
        self._synced_rows += rows.size
        return rows, np.asarray(self.store[rows]), np.asarray(self.store_accumulator[rows])

    def mark_replicas_alike(self) -> None:
        """Every replica holds the same table now (after a broadcast): no row to sync."""
        self._written_since_sync = []

    @property
    def replica_state(self) -> tuple:
        """The variables a weight sync averages with the cache whatever the optimizer:
        the cache's row state, which moves with its rows."""
        return (self.cache_accumulator,)

    def broadcast_rows(self, broadcast: Callable[[np.ndarray, str], np.ndarray]) -> None:
        """Makes this replica's rows and row state, file and cache, the root replica's, a
        block at a time: ``broadcast(values, what)`` returns the root's ``values``
        (``what``: "rows" or "state"). The replicas are alike after it."""
        self.flush()
        for start, stop in self.blocks():
            values = broadcast(self.read_rows(start, stop), "rows")
            state = broadcast(self.read_accumulator(start, stop), "state")
            self.write_rows(start, values, state)
        self.mark_replicas_alike()

    def stats(self) -> dict:
        """Distinct ids per call that found their row cached (``hits``) or loaded it
        (``misses``), rows written back, store rows averaged by weight syncs
        (``synced_rows``), slots holding a row, and the hit rate."""
        looked = self._hits + self._misses
        return {"hits": self._hits, "misses": self._misses,
                "writebacks": self._writebacks, "synced_rows": self._synced_rows,
                "cached_rows": self._filled,
                "hit_rate": self._hits / looked if looked else 0.0}

    def rows_in_slots(self) -> np.ndarray:
        """A copy of the table row each cache slot holds (-1: an empty slot)."""
        return self._row_of_slot.copy()

    def memory_bytes(self) -> dict:
        """Bytes in DRAM (the cache, its accumulator and the host index) and in the
        store."""
        index = sum(a.nbytes for a in (self._slot_of_row, self._row_of_slot, self._stamp,
                                         self._referenced, self._last_used, self._used))
        return {"cache": self.cache_rows * (self.dim + 1) * 4, "index": index,
                "store": self.rows * (self.dim + 1) * 4}

    # ------------------------------------------------------------ whole rows
    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start..stop-1`` as they are now (cached rows from the cache)."""
        values = np.array(self.store[start:stop])
        return self._overlay(start, stop, values, self.cache)

    def read_accumulator(self, start: int, stop: int) -> np.ndarray:
        values = np.array(self.store_accumulator[start:stop])
        return self._overlay(start, stop, values, self.cache_accumulator)

    def _overlay(self, start: int, stop: int, values: np.ndarray, cached) -> np.ndarray:
        slots = self._slot_of_row[start:stop]
        held = np.nonzero(slots >= 0)[0]
        if held.size:
            values[held] = tf.gather(cached, slots[held]).numpy()
        return values

    def write_rows(self, start: int, values: Any, accumulator: Any = None) -> None:
        """Sets rows ``start..start+len(values)-1`` (and their accumulators, where given;
        else they keep theirs), in the store and in the cache where cached."""
        values = np.asarray(values, np.float32)
        stop = start + values.shape[0]
        if values.ndim != 2 or values.shape[1] != self.dim or start < 0 or \
                stop > self.rows:
            raise ValueError(f"CachedTable {self.name!r}.write_rows({start}, shape "
                             f"{values.shape}): expected [n, {self.dim}] rows within "
                             f"[0, {self.rows})")
        self.store[start:stop] = values
        if accumulator is not None:
            accumulator = np.asarray(accumulator, np.float32)
            self.store_accumulator[start:stop] = accumulator
        slots = self._slot_of_row[start:stop]
        held = np.nonzero(slots >= 0)[0]
        if held.size:
            self.cache.scatter_update(tf.IndexedSlices(values[held], slots[held]))
            if accumulator is not None:
                self.cache_accumulator.scatter_update(
                    tf.IndexedSlices(accumulator[held], slots[held]))

    def write_accumulator(self, start: int, accumulator: Any) -> None:
        """Sets the row-wise optimizer state of rows ``start..start+len-1`` (store and
        cache)."""
        accumulator = np.asarray(accumulator, np.float32)
        stop = start + accumulator.shape[0]
        if accumulator.ndim != 1 or start < 0 or stop > self.rows:
            raise ValueError(f"CachedTable {self.name!r}.write_accumulator({start}, shape "
                             f"{accumulator.shape}): expected [n] values within "
                             f"[0, {self.rows})")
        self.store_accumulator[start:stop] = accumulator
        slots = self._slot_of_row[start:stop]
        held = np.nonzero(slots >= 0)[0]
        if held.size:
            self.cache_accumulator.scatter_update(
                tf.IndexedSlices(accumulator[held], slots[held]))

    def whole(self, accumulator: bool = False) -> tf.Tensor:
        """The whole table (``[rows, dim]``) or its accumulator (``[rows]``) in row order,
        as a tensor, eagerly or inside a ``tf.function`` (a checkpoint's read)."""
        read = self.read_accumulator if accumulator else self.read_rows
        value = tf.py_function(lambda: read(0, self.rows), [], tf.float32,
                               name=f"{self.name}_whole")
        value.set_shape([self.rows] if accumulator else [self.rows, self.dim])
        return value

    def assign_whole(self, value: tf.Tensor, accumulator: bool = False) -> tf.Tensor:
        """Sets the whole table or its accumulator from ``value`` (a checkpoint's
        restore); returns a tensor to wait on, eagerly or inside a ``tf.function``."""
        def write(values):
            if accumulator:
                self.write_accumulator(0, values.numpy())
            else:
                self.write_rows(0, values.numpy())
            return np.int32(0)
        return tf.py_function(write, [tf.cast(value, tf.float32)], tf.int32,
                              name=f"{self.name}_assign_whole")

    # ------------------------------------------------------------ checkpoints
    def _refuse_saved_model(self) -> None:
        raise ValueError(
            f"table {self.name!r} lives in the disk tier (cache_rows) and cannot be "
            "part of a SavedModel: its rows are in a file and its lookups run on the "
            "host. Save its training state with model.save_weights or "
            "tf.train.Checkpoint; to serve, build the model with the table in memory "
            "(no cache_rows) and set_weights from this layer's get_weights()")

    def _trackable_children(self, save_type=_tf_internals.SaveType.CHECKPOINT, **kwargs):
        # every SavedModel writer walks the objects it saves (Keras 3's model.export
        # saves the weights and the traced call, never asking the table for its state)
        if save_type == _tf_internals.SaveType.SAVEDMODEL:
            self._refuse_saved_model()
        return super()._trackable_children(save_type, **kwargs)

    def _serialize_to_tensors(self):
        if not tf.executing_eagerly():
            # traced: a SavedModel's save function. Its graph could only reach the file
            # through a Python callback, which a SavedModel loaded elsewhere lacks (and
            # so do the lookups, whose rows come through the host)
            self._refuse_saved_model()
        # the cache is slot-ordered and meaningless without the host index, so a
        # checkpoint holds the table in row order: the store, flushed first
        self.flush()
        return {"values": tf.constant(np.asarray(self.store)),
                "accumulator": tf.constant(np.asarray(self.store_accumulator))}

    def _restore_from_tensors(self, restored_tensors):
        self._restore({key: value.numpy() for key, value in restored_tensors.items()},
                      "the checkpoint")
        return tf.no_op()

    def _restore(self, saved: dict, source: str) -> None:
        """Replaces the table by ``saved`` (``_serialize_to_tensors``' arrays) read from
        ``source``, after checking its shapes; the cache starts empty."""
        values, accumulator = saved["values"], saved["accumulator"]
        if values.shape != (self.rows, self.dim) or accumulator.shape != (self.rows,):
            raise ValueError(f"CachedTable {self.name!r}: {source} holds a "
                             f"{list(values.shape)} table with a {list(accumulator.shape)} "
                             f"accumulator; this one is [{self.rows}, {self.dim}] with "
                             f"[{self.rows}]")
        self.invalidate()
        self.store[:] = values
        self.store_accumulator[:] = accumulator

    # ------------------------------------------------------------ weights files
    def save_own_variables(self, store: Any) -> None:
        """Writes the table to ``store``, a Keras weights file's entry for the layer that
        holds it (``save_own_variables``): the rows in row order, as a checkpoint holds
        them (the store, flushed first), not the cache."""
        self.flush()
        for key, value in self._state_arrays().items():
            store[key] = value

    def load_own_variables(self, store: Any) -> None:
        """Reads what :meth:`save_own_variables` wrote."""
        names, expected = sorted(store.keys()), sorted(self._state_arrays())
        if names != expected:
            raise ValueError(f"the weights file holds {names} for tiered table "
                             f"{self.name!r}, which saves {expected}")
        self._restore({key: np.asarray(store[key]) for key in names}, "the weights file")

    def _state_arrays(self) -> dict:
        """The table's state in row order, by name (the store: flush first)."""
        return {"values": np.asarray(self.store),
                "accumulator": np.asarray(self.store_accumulator)}
