"""``Predictor``: raw inputs in, scores out, from an export and its store.

Per call: check the inputs against the export's (a ``ValueError`` names a missing,
extra or malformed input; a ragged input travels as its values and row splits), take
every external feature's ids (or a dynamic table's 64-bit keys): read from the request
itself where the export found them to be columns of an input, else from the
SavedModel's ``feature_ids`` signature; check ids against their tables' rows, fetch
every distinct row (and column slice) of every external table in one ``RedisStore.get``
(one pipelined request per Redis node, the nodes in parallel), dequantize and join
slices into one matrix of rows, and run the ``external_rows`` signature on it with each
id's position in it: the SavedModel gathers and combines the bags itself. A key a
dynamic table does not hold reads the table's default row (counted in
``stats["default_rows"]``). A model without external tables runs ``serving_default``
directly.

Imports TensorFlow, NumPy and redis-py only: a serving process needs neither Horovod nor
tfhybrid's op library.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.serving.inputs import batch_size, request_tensors
from tfhybrid.serving.rows import decode
from tfhybrid.serving.store import RedisStore
from tfhybrid.serving.wire import RowKeys


class RowCache:
    """Rows of a served version's fixed tables a predictor fetched, by id, up to
    ``capacity`` rows: a request's ids the cache holds are not fetched again. Rows enter
    as they are first fetched and stay until the cache is full (recommendation ids are
    skewed: the first fetched are mostly the hot ones); a new version starts a new
    cache, so a publish's rows are read once it has completed. Dynamic tables' rows are
    always fetched (a key's row may appear or go at any publish).

    Example::

        import numpy as np
        from tfhybrid.serving.predictor import RowCache
        cache = RowCache(capacity=2, width=3)
        cache.add(np.array([7, 9, 11]), np.arange(9, dtype=np.float32).reshape(3, 3))
        found = cache.find(np.array([9, 11, 7]))
        assert found.tolist() == [1, -1, 0]
        assert cache.rows_at(found[:1]).tolist() == [[3.0, 4.0, 5.0]]
    """

    def __init__(self, capacity: int, width: int):
        self.capacity = int(capacity)
        self.slot_of: dict[int, int] = {}
        self.rows = np.zeros([min(self.capacity, 1024), width], np.float32)
        self.lock = threading.Lock()

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot in the cache, -1 where it holds none."""
        with self.lock:
            # dict.get mapped in C over the ids: a generator's Python step per id cost
            # more than the lookups
            return np.array(list(map(self.slot_of.get, ids.tolist(),
                                     itertools.repeat(-1, len(ids)))), np.int64)

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """The rows in ``slots`` (of :meth:`find`)."""
        with self.lock:
            return self.rows[slots]

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keeps the rows of ``ids`` (not held yet) while there is room."""
        with self.lock:
            held = len(self.slot_of)
            count = min(len(ids), self.capacity - held)
            if count <= 0:
                return
            if held + count > len(self.rows):
                grown = np.zeros([min(self.capacity, max(2 * len(self.rows), held + count)),
                                  self.rows.shape[1]], np.float32)
                grown[:held] = self.rows[:held]
                self.rows = grown
            self.rows[held:held + count] = rows[:count]
            self.slot_of.update(zip(ids[:count].tolist(), range(held, held + count)))


class _Layout:
    """What a call needs of a version's manifest, worked out once: the ids matrix's
    columns of each external table, and for fixed tables each column's row range and
    its offset in one id space of all of them (so one ``np.unique`` finds the distinct
    rows of every fixed table at once)."""

    def __init__(self, manifest: dict, cache_bytes: int = 0):
        tables, by_key = [], {}
        ragged = set(manifest.get("ragged_features") or [])
        for layer in manifest["layers"]:
            for feature in layer["features"]:
                table = layer["tables"][feature["table"]]
                if not table["external"]:
                    continue
                if table["key"] not in by_key:
                    by_key[table["key"]] = (table, [], [])
                    tables.append(table["key"])
                if feature["key"] in ragged:
                    by_key[table["key"]][2].append(feature["key"])
                    continue
                start, stop = manifest["id_columns"][feature["key"]]
                by_key[table["key"]][1].append((feature["key"], start, stop))
        self.width = int(manifest["row_width"])
        self.total = max((stop for _, stop in manifest["id_columns"].values()), default=0)
        self.fixed = [by_key[k][:2] for k in tables if "dynamic" not in by_key[k][0]]
        # a ragged feature's ids come flat, beside the matrix: (feature, fixed table)
        self.fixed_ragged = [(key, i) for i, k in enumerate(
            k for k in tables if "dynamic" not in by_key[k][0]) for key in by_key[k][2]]
        self.dynamic = [(table, np.concatenate([np.arange(a, b) for _, a, b in cols] or
                                               [np.zeros([0], np.int64)]), ragged_keys)
                        for table, cols, ragged_keys in (by_key[k] for k in tables)
                        if "dynamic" in table]
        self.ragged = sorted(ragged)
        # fixed tables' columns, their tables' rows and offsets in the one id space
        self.fixed_columns = np.concatenate(
            [np.arange(a, b) for _, cols in self.fixed for _, a, b in cols] or
            [np.zeros([0], np.int64)]).astype(np.int64)
        self.all_fixed = np.array_equal(self.fixed_columns, np.arange(self.total))
        bases = np.cumsum([0] + [table["rows"] for table, _ in self.fixed]).astype(np.int64)
        self.bases = bases
        limit, base, owner = [], [], []
        for i, (table, cols) in enumerate(self.fixed):
            for _, a, b in cols:
                limit += [table["rows"]] * (b - a)
                base += [bases[i]] * (b - a)
                owner += [i] * (b - a)
        self.limit = np.array(limit, np.int64)
        self.base = np.array(base, np.int64)
        self.owner = np.array(owner, np.int64)
        # the fixed tables' slices: a request's keys of slice s are built for every table
        # with an s-th slice at once, and decoded by column range and precision
        self.fixed_names = [table["key"] for table, _ in self.fixed]
        self.slice_counts = np.array([len(table["slices"]) for table, _ in self.fixed],
                                     np.int64)
        self.most_slices = int(self.slice_counts.max()) if len(self.fixed) else 0
        self.all_sliced = [bool((self.slice_counts > s).all())
                           for s in range(self.most_slices)]
        self.slice_groups: list[dict[tuple, np.ndarray | None]] = []
        for s in range(self.most_slices):
            groups: dict[tuple, np.ndarray] = {}
            for i, (table, _) in enumerate(self.fixed):
                if len(table["slices"]) > s:
                    a, b = table["slices"][s]
                    groups.setdefault((a, b, table["precision"]),
                                      np.zeros(len(self.fixed), bool))[i] = True
            # None: the group is every table with an s-th slice
            self.slice_groups.append({k: None if len(groups) == 1 else mask
                                      for k, mask in groups.items()})
        self.feature_of_column = {}
        for table, cols in self.fixed:
            for key, a, b in cols:
                self.feature_of_column.update({c: (key, table) for c in range(a, b)})
        sources = manifest.get("id_sources")
        self.id_groups = None if not sources else _id_groups(manifest["id_columns"], sources)
        self.ragged_sources = None if not sources else {k: sources[k]["input"]
                                                        for k in self.ragged}
        capacity = cache_bytes // (4 * max(self.width, 1))
        self.cache = RowCache(capacity, self.width) if capacity and self.fixed else None

    def ids_of(self, inputs: dict[str, np.ndarray], batch: int
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """What ``feature_ids`` would give (the ids matrix, and each ragged feature's ids),
        read from the request's tensors themselves: the export found every external
        feature's ids to be columns of an input, or a ragged input's values."""
        ragged = {k: inputs[name].astype(np.int64, copy=False)
                  for k, name in self.ragged_sources.items()}
        ids = np.empty([batch, self.total], np.int64)
        for name, outer, axis, first, count, start, stop in self.id_groups:
            value = inputs[name]
            for at, index in outer:
                value = np.take(value, index, axis=at)
            if axis is not None:
                value = np.moveaxis(value[(slice(None),) * axis + (slice(first, first + count),)],
                                    axis, 1)
            ids[:, start:stop] = value.reshape(batch, -1)
        return ids, ragged


def _id_groups(columns: dict, sources: dict) -> list[tuple]:
    """The features' ``id_sources`` in column order, runs of them that are neighbouring
    columns of one input (``tf.unstack``'s outputs in order, as the app's models take
    theirs) joined: ``(input, outer unstacks, axis, first, count, start, stop)``."""
    groups: list[list] = []
    for key in sorted(columns, key=lambda k: columns[k][0]):
        start, stop = columns[key]
        source = sources[key]
        unpacked = [tuple(u) for u in source["unpacked"]]
        outer, last = (unpacked[:-1], unpacked[-1]) if unpacked else ([], None)
        if groups and last is not None:
            name, g_outer, axis, first, count, g_start, g_stop = groups[-1]
            if (name, g_outer, axis) == (source["input"], outer, last[0]) and \
                    first + count == last[1] and g_stop == start:
                groups[-1][4:] = [count + 1, g_start, stop]
                continue
        groups.append([source["input"], outer, None if last is None else last[0],
                       0 if last is None else last[1], 1, start, stop])
    return [tuple(g) for g in groups]


class Predictor:
    """Serves an export of ``tfhybrid.serving.export`` with rows from ``store``.

    Args:
      saved_model_dir: the export's base folder (the newest version is served, and a
        newer one is picked up at the next call) or one version folder.
      store: the ``RedisStore`` of the external tables (None if every table is inline).
      deadline_s: each call's limit (fetching rows from every node included).
      cache_mb: MB of fixed tables' rows kept per served version (``RowCache``: a row the
        cache holds is not fetched again until a new version is served); 0: none.

    ``stats`` counts calls, rows and keys fetched, ``cache_hits`` (distinct rows a call
    read from the cache) and ``default_rows``: the keys (once per call) that a dynamic
    table did not hold, which read its default row. Calls are thread-safe.

    Example (an export with inline tables only needs no store)::

        import tempfile
        import numpy as np
        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding
        from tfhybrid.serving import Predictor, export
        tfhybrid.init(model_parallel=1)
        ids = tf.keras.Input([2], dtype=tf.int32, name="ids")
        (vector,) = DistributedEmbedding([tf.keras.layers.Embedding(50, 4)])([ids])
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(vector))
        directory = tempfile.mkdtemp()
        export(model, directory)
        scores = Predictor(directory)({"ids": np.array([[1, 2]], np.int32)})["output"]
        assert np.allclose(scores, model.predict(np.array([[1, 2]], np.int32), verbose=0))
    """

    def __init__(self, saved_model_dir: str, store: RedisStore | None = None,
                 deadline_s: float = 10.0, cache_mb: float = 64.0):
        if not deadline_s > 0:
            raise ValueError(f"deadline_s={deadline_s!r} must be > 0")
        if not cache_mb >= 0:
            raise ValueError(f"cache_mb={cache_mb!r} must be >= 0")
        self.cache_mb = float(cache_mb)
        self.base = saved_model_dir
        self.store = store
        self.deadline_s = float(deadline_s)
        self.stats = {"calls": 0, "rows_fetched": 0, "keys_fetched": 0, "cache_hits": 0,
                      "default_rows": 0}
        self._lock = threading.Lock()
        self.version_dir = ""
        self._load()

    # ------------------------------------------------------------------ loading
    def _newest(self) -> str:
        if os.path.exists(os.path.join(self.base, manifest_lib.MANIFEST_PATH)):
            return self.base
        versions = manifest_lib.version_folders(self.base)
        if not versions:
            raise ValueError(f"saved_model_dir={self.base!r} holds no export (no version "
                             f"folder with {manifest_lib.MANIFEST_PATH})")
        return os.path.join(self.base, str(versions[-1]))

    def _load(self) -> None:
        version_dir = self._newest()
        if version_dir == self.version_dir:
            return
        manifest = manifest_lib.read(version_dir)
        loaded = tf.saved_model.load(version_dir)
        external = any(table["external"] for layer in manifest["layers"]
                       for table in layer["tables"])
        if external and self.store is None:
            raise ValueError(f"the export at {version_dir!r} has external tables; "
                             "Predictor needs store=RedisStore(...)")
        if external and manifest["key_prefix"] != self.store.key_prefix:
            raise ValueError(f"the export at {version_dir!r} wrote its rows under "
                             f"key_prefix={manifest['key_prefix']!r}; the store given has "
                             f"key_prefix={self.store.key_prefix!r}")
        layout = (_Layout(manifest, int(self.cache_mb * (1 << 20)))
                  if manifest.get("id_columns") else None)
        with self._lock:
            self.manifest, self.loaded, self.layout = manifest, loaded, layout
            self.version_dir = version_dir
            self.version = int(manifest["version"])

    def reload(self) -> None:
        """Serves the newest version folder of the base folder (if it changed)."""
        self._load()

    # ------------------------------------------------------------------ call
    def __call__(self, inputs: Any) -> dict[str, np.ndarray]:
        """The model's outputs (NumPy) for raw ``inputs`` (a dict by input name, or a
        list in the export's order, or one array for a one-input model; a ragged input
        as a ``tf.RaggedTensor`` or a list of rows)."""
        start = time.monotonic()
        self._load()
        with self._lock:
            manifest, loaded, layout = self.manifest, self.loaded, self.layout
        flat = request_tensors(manifest["inputs"], inputs)
        tensors = {k: tf.constant(v) for k, v in flat.items()}
        self.stats["calls"] += 1
        if layout is None:
            out = loaded.signatures[manifest_lib.INLINE_SIGNATURE](**tensors)
            return {k: v.numpy() for k, v in out.items()}
        if layout.id_groups is not None:
            ids, ragged_ids = layout.ids_of(flat, batch_size(manifest["inputs"], flat))
        else:
            found = loaded.signatures[manifest_lib.IDS_SIGNATURE](**tensors)
            ids = found[manifest_lib.IDS_OUTPUT].numpy()
            ragged_ids = {k: found[manifest_lib.ragged_ids_output(k)].numpy()
                          for k in layout.ragged}
        rows, positions, ragged_positions = self._rows(layout, ids, ragged_ids, start)
        served = {manifest_lib.ROWS_INPUT: tf.constant(rows),
                  manifest_lib.POSITIONS_INPUT: tf.constant(positions)}
        served.update({manifest_lib.ragged_positions_input(k): tf.constant(v)
                       for k, v in ragged_positions.items()})
        out = loaded.signatures[manifest_lib.EXTERNAL_SIGNATURE](**tensors, **served)
        return {k: v.numpy() for k, v in out.items()}

    predict = __call__

    @staticmethod
    def _joined(dense: np.ndarray, ragged: list[np.ndarray]) -> np.ndarray:
        """One flat array of a matrix's ids and ragged features' ids (no copy for none)."""
        return dense.reshape(-1) if not ragged else np.concatenate(
            [dense.reshape(-1)] + ragged)

    def _check_fixed(self, layout: _Layout, sub: np.ndarray,
                     ragged_ids: dict[str, np.ndarray]) -> None:
        """ValueError naming the first feature with an id outside its table's rows."""
        bad = (sub < 0) | (sub >= layout.limit)
        if bad.any():
            column = int(np.flatnonzero(bad.any(axis=0))[0])
            key, table = layout.feature_of_column[int(layout.fixed_columns[column])]
            outside = sub[:, layout.owner == layout.owner[column]]
            outside = outside[(outside < 0) | (outside >= table["rows"])]
            raise ValueError(f"inputs: feature {key} (table {table['key']}) has ids "
                             f"{sorted(set(outside.tolist()))[:5]} outside [0, "
                             f"{table['rows']})")
        for key, i in layout.fixed_ragged:
            table, values = layout.fixed[i][0], ragged_ids[key]
            outside = values[(values < 0) | (values >= table["rows"])]
            if len(outside):
                raise ValueError(f"inputs: feature {key} (table {table['key']}) has ids "
                                 f"{sorted(set(outside.tolist()))[:5]} outside [0, "
                                 f"{table['rows']})")

    def _rows(self, layout: _Layout, ids: np.ndarray, ragged_ids: dict[str, np.ndarray],
              start: float) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The distinct rows the request looks up, [n, width] (a narrower table's in its
        first columns), each id's row among them ([batch, columns] int32) and each ragged
        feature's ids' rows (flat int32): one store request for every table. The fixed
        tables' keys are built for all of them at once, slice by slice."""
        positions = np.empty(ids.shape, np.int32)
        ragged_positions: dict[str, np.ndarray] = {}
        keys: list[RowKeys] = []
        slots: list[np.ndarray] = []
        count = 0
        # fixed tables: (slice, its distinct ids' indices, their tables, first key)
        fixed_spans: list[tuple[int, np.ndarray, np.ndarray, int]] = []
        n = 0
        cached = None       # each distinct fixed row's slot in the row cache (-1: none)
        if len(layout.fixed_columns) or layout.fixed_ragged:
            sub = ids if layout.all_fixed else ids[:, layout.fixed_columns]
            self._check_fixed(layout, sub, ragged_ids)
            ragged = [ragged_ids[key] + layout.bases[i] for key, i in layout.fixed_ragged]
            unique, inverse = np.unique(self._joined(sub + layout.base, ragged),
                                        return_inverse=True)
            if layout.all_fixed:
                positions[:] = inverse[:sub.size].reshape(sub.shape)
            else:
                positions[:, layout.fixed_columns] = inverse[:sub.size].reshape(sub.shape)
            at = sub.size
            for (key, _), values in zip(layout.fixed_ragged, ragged):
                ragged_positions[key] = inverse[at:at + len(values)].astype(np.int32)
                at += len(values)
            which = np.searchsorted(layout.bases, unique, side="right") - 1
            local = unique - layout.bases[which]
            # rows the cache holds are not fetched: fetched, the distinct ids' indices to
            # fetch
            fetched = np.arange(len(unique))
            if layout.cache is not None:
                cached = layout.cache.find(unique)
                fetched = np.flatnonzero(cached < 0)
            for s in range(layout.most_slices):
                taken = fetched if s == 0 or layout.all_sliced[s] else fetched[
                    layout.slice_counts[which[fetched]] > s]
                at_which, at_local = which[taken], local[taken]
                if not len(taken):
                    continue        # the cache holds every row of this slice
                fixed_spans.append((s, taken, at_which, count))
                keys.append(self.store.tables_row_keys(layout.fixed_names, at_which,
                                                       at_local, s))
                count += len(at_which)
                slots.append(self.store.tables_row_slots(layout.fixed_names, at_which,
                                                         at_local, s))
            n = len(unique)
        # dynamic tables: (table, its keys, their first row in the matrix, first key)
        dynamic_spans = []
        for table, columns, ragged_keys in layout.dynamic:
            dense = ids[:, columns]
            table_keys, inverse = np.unique(
                self._joined(dense, [ragged_ids[k] for k in ragged_keys]),
                return_inverse=True)
            positions[:, columns] = n + inverse[:dense.size].reshape(dense.shape)
            at = dense.size
            for key in ragged_keys:
                length = len(ragged_ids[key])
                ragged_positions[key] = (n + inverse[at:at + length]).astype(np.int32)
                at += length
            for s in range(len(table["slices"])):
                dynamic_spans.append((table, table_keys, n, count))
                keys.append(self.store.row_keys(table["key"], table_keys, s))
                count += len(table_keys)
                slots.append(self.store.row_slots(table["key"], table_keys, s))
            n += len(table_keys)
        left = self.deadline_s - (time.monotonic() - start)
        if left <= 0:
            raise TimeoutError(f"Predictor: the deadline of {self.deadline_s} s passed "
                               "before the rows were requested")
        keys = RowKeys.joined(keys)
        values = self.store.get(keys, deadline_s=left, slots=np.concatenate(slots)
                                ) if len(keys) else []
        self.stats["keys_fetched"] += len(keys)
        hits = np.zeros([0], np.int64)
        rows = np.zeros([n, layout.width], np.float32)
        for s, taken, at_which, first in fixed_spans:
            chunk = values[first:first + len(at_which)]
            if None in chunk:
                absent = [i for i, v in enumerate(chunk) if v is None]
                table = layout.fixed[int(at_which[absent[0]])][0]
                missing = [keys[first + i].decode() for i in absent
                           if layout.fixed[int(at_which[i])][0] is table]
                raise LookupError(f"Predictor: the store has no key {missing[:5]} "
                                  f"({len(missing)} missing) of table {table['key']}: the "
                                  "export did not finish, or the store lost them")
            # the tables of one column range and precision are decoded in one go
            for (a, b, precision), members in layout.slice_groups[s].items():
                if members is None:
                    rows[taken, a:b] = decode(chunk, b - a, precision)
                    continue
                mine = np.flatnonzero(members[at_which])
                if len(mine):
                    rows[taken[mine], a:b] = decode([chunk[i] for i in mine.tolist()],
                                                    b - a, precision)
        if cached is not None:
            hits = np.flatnonzero(cached >= 0)
            rows[hits] = layout.cache.rows_at(cached[hits])
            layout.cache.add(unique[fetched], rows[fetched])
        self.stats["cache_hits"] += len(hits)
        self.stats["rows_fetched"] += n - len(hits)
        for table, table_keys, first_row, first in dynamic_spans:
            self._dynamic_rows(table, table_keys, values[first:first + len(table_keys)],
                               rows[first_row:first_row + len(table_keys)])
        return rows, positions, ragged_positions

    def _dynamic_rows(self, table: dict, keys: np.ndarray, values: list, rows: np.ndarray
                      ) -> None:
        """A dynamic table's rows into ``rows``: a key it holds reads its row, a key it
        does not hold (never admitted, or evicted) the default row, counted once per
        call."""
        held = np.array([v is not None for v in values], bool)
        rows[:, :table["dim"]] = np.asarray(table["dynamic"]["default_row"], np.float32)
        if held.any():
            rows[held, :table["dim"]] = decode([v for v in values if v is not None],
                                               table["dim"], table["precision"])
        self.stats["default_rows"] += int(len(keys) - held.sum())
