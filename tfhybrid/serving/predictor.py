"""``Predictor``: raw inputs in, scores out, from an export and its store.

Per call: check the inputs against the export's (a ``ValueError`` names a missing,
extra or malformed input), run the SavedModel's ``feature_ids`` signature (every
external feature's ids, or a dynamic table's 64-bit keys, side by side in one matrix),
check ids against their tables' rows, fetch every distinct row (and column slice) of
every external table in one ``RedisStore.get`` (one pipelined request per Redis node,
the nodes in parallel), dequantize and join slices into one matrix of rows, and run the
``external_rows`` signature on it with each id's position in it: the SavedModel gathers
and combines the bags itself. A key a dynamic table does not hold reads the table's
default row (counted in ``stats["default_rows"]``). A model without external tables
runs ``serving_default`` directly.

Imports TensorFlow, NumPy and redis-py only: a serving process needs neither Horovod nor
tfhybrid's op library.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.serving.rows import decode
from tfhybrid.serving.store import RedisStore


class _Layout:
    """What a call needs of a version's manifest, worked out once: the ids matrix's
    columns of each external table, and for fixed tables each column's row range and
    its offset in one id space of all of them (so one ``np.unique`` finds the distinct
    rows of every fixed table at once)."""

    def __init__(self, manifest: dict):
        tables, by_key = [], {}
        for layer in manifest["layers"]:
            for feature in layer["features"]:
                table = layer["tables"][feature["table"]]
                if not table["external"]:
                    continue
                if table["key"] not in by_key:
                    by_key[table["key"]] = (table, [])
                    tables.append(table["key"])
                start, stop = manifest["id_columns"][feature["key"]]
                by_key[table["key"]][1].append((feature["key"], start, stop))
        self.width = int(manifest["row_width"])
        self.total = max((stop for _, stop in manifest["id_columns"].values()), default=0)
        self.fixed = [by_key[k] for k in tables if "dynamic" not in by_key[k][0]]
        self.dynamic = [(table, np.concatenate([np.arange(a, b) for _, a, b in cols]))
                        for table, cols in (by_key[k] for k in tables)
                        if "dynamic" in table]
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


class Predictor:
    """Serves an export of ``tfhybrid.serving.export`` with rows from ``store``.

    Args:
      saved_model_dir: the export's base folder (the newest version is served, and a
        newer one is picked up at the next call) or one version folder.
      store: the ``RedisStore`` of the external tables (None if every table is inline).
      deadline_s: each call's limit (fetching rows from every node included).

    ``stats`` counts calls, rows and keys fetched, and ``default_rows``: the keys (once
    per call) that a dynamic table did not hold, which read its default row. Calls are
    thread-safe.

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
                 deadline_s: float = 10.0):
        if not deadline_s > 0:
            raise ValueError(f"deadline_s={deadline_s!r} must be > 0")
        self.base = saved_model_dir
        self.store = store
        self.deadline_s = float(deadline_s)
        self.stats = {"calls": 0, "rows_fetched": 0, "keys_fetched": 0, "default_rows": 0}
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
        layout = _Layout(manifest) if manifest.get("id_columns") else None
        with self._lock:
            self.manifest, self.loaded, self.layout = manifest, loaded, layout
            self.version_dir = version_dir
            self.version = int(manifest["version"])

    def reload(self) -> None:
        """Serves the newest version folder of the base folder (if it changed)."""
        self._load()

    # ------------------------------------------------------------------ checks
    def _checked(self, inputs: Any) -> dict[str, np.ndarray]:
        expected = self.manifest["inputs"]
        if not isinstance(inputs, dict):
            if len(expected) == 1 and not isinstance(inputs, (list, tuple)):
                inputs = {next(iter(expected)): inputs}
            elif isinstance(inputs, (list, tuple)):
                if len(inputs) != len(expected):
                    raise ValueError(f"inputs: got {len(inputs)} inputs; the model takes "
                                     f"{len(expected)} ({sorted(expected)})")
                inputs = dict(zip(expected, inputs))
            else:
                raise ValueError(f"inputs: expected a dict of {sorted(expected)}; got "
                                 f"{type(inputs).__name__}")
        missing = sorted(set(expected) - set(inputs))
        extra = sorted(set(inputs) - set(expected))
        if missing or extra:
            raise ValueError(f"inputs: missing {missing}, unexpected {extra}; the model "
                             f"takes {sorted(expected)}")
        checked = {}
        for name, spec in expected.items():
            value = np.asarray(inputs[name])
            dtype = np.dtype(tf.as_dtype(spec["dtype"]).as_numpy_dtype)
            if dtype == np.dtype(object) and value.dtype.kind in "USO":
                value = value.astype(object)     # strings, as str or bytes
            if value.dtype != dtype:
                same_kind = (np.issubdtype(value.dtype, np.integer) and
                             np.issubdtype(dtype, np.integer)) or (
                    np.issubdtype(value.dtype, np.floating) and
                    np.issubdtype(dtype, np.floating))
                if not same_kind:
                    raise ValueError(f"inputs[{name!r}] has dtype {value.dtype}; the model "
                                     f"takes {dtype}")
                value = value.astype(dtype)
            shape = spec["shape"]
            if value.ndim != len(shape) or any(
                    want is not None and want != got for want, got in zip(shape, value.shape)):
                raise ValueError(f"inputs[{name!r}] has shape {list(value.shape)}; the model "
                                 f"takes {shape} (None: any size)")
            checked[name] = value
        batches = {v.shape[0] for v in checked.values() if v.ndim}
        if len(batches) > 1:
            raise ValueError(f"inputs: batch sizes differ: "
                             f"{ {n: v.shape[0] for n, v in checked.items()} }")
        return checked

    # ------------------------------------------------------------------ call
    def __call__(self, inputs: Any) -> dict[str, np.ndarray]:
        """The model's outputs (NumPy) for raw ``inputs`` (a dict by input name, or a
        list in the export's order, or one array for a one-input model)."""
        start = time.monotonic()
        self._load()
        with self._lock:
            manifest, loaded, layout = self.manifest, self.loaded, self.layout
        checked = self._checked(inputs)
        tensors = {k: tf.constant(v) for k, v in checked.items()}
        self.stats["calls"] += 1
        if layout is None:
            out = loaded.signatures[manifest_lib.INLINE_SIGNATURE](**tensors)
            return {k: v.numpy() for k, v in out.items()}
        ids = loaded.signatures[manifest_lib.IDS_SIGNATURE](**tensors)[
            manifest_lib.IDS_OUTPUT].numpy()
        rows, positions = self._rows(layout, ids, start)
        out = loaded.signatures[manifest_lib.EXTERNAL_SIGNATURE](
            **tensors, **{manifest_lib.ROWS_INPUT: tf.constant(rows),
                          manifest_lib.POSITIONS_INPUT: tf.constant(positions)})
        return {k: v.numpy() for k, v in out.items()}

    predict = __call__

    def _rows(self, layout: _Layout, ids: np.ndarray, start: float
              ) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows the request looks up, [n, width] (a narrower table's in its
        first columns), and each id's row among them ([batch, columns] int32): one store
        request for every table. The fixed tables' keys are built for all of them at
        once, slice by slice."""
        positions = np.empty(ids.shape, np.int32)
        keys: list[bytes] = []
        slots: list[np.ndarray] = []
        # fixed tables: (slice, its distinct ids' indices, their tables, first key)
        fixed_spans: list[tuple[int, np.ndarray | None, np.ndarray, int]] = []
        n = 0
        if len(layout.fixed_columns):
            sub = ids if layout.all_fixed else ids[:, layout.fixed_columns]
            bad = (sub < 0) | (sub >= layout.limit)
            if bad.any():
                column = int(np.flatnonzero(bad.any(axis=0))[0])
                key, table = layout.feature_of_column[int(layout.fixed_columns[column])]
                outside = sub[:, layout.owner == layout.owner[column]]
                outside = outside[(outside < 0) | (outside >= table["rows"])]
                raise ValueError(f"inputs: feature {key} (table {table['key']}) has ids "
                                 f"{sorted(set(outside.tolist()))[:5]} outside [0, "
                                 f"{table['rows']})")
            unique, inverse = np.unique(sub + layout.base, return_inverse=True)
            inverse = inverse.reshape(sub.shape)
            if layout.all_fixed:
                positions[:] = inverse
            else:
                positions[:, layout.fixed_columns] = inverse
            which = np.searchsorted(layout.bases, unique, side="right") - 1
            local = unique - layout.bases[which]
            for s in range(layout.most_slices):
                taken = None if s == 0 or layout.all_sliced[s] else np.flatnonzero(
                    layout.slice_counts[which] > s)
                at_which = which if taken is None else which[taken]
                at_local = local if taken is None else local[taken]
                fixed_spans.append((s, taken, at_which, len(keys)))
                keys.extend(self.store.tables_row_keys(layout.fixed_names, at_which,
                                                       at_local, s))
                slots.append(self.store.tables_row_slots(layout.fixed_names, at_which,
                                                         at_local, s))
            n = len(unique)
        # dynamic tables: (table, its keys, their first row in the matrix, first key)
        dynamic_spans = []
        for table, columns in layout.dynamic:
            table_keys, inverse = np.unique(ids[:, columns], return_inverse=True)
            positions[:, columns] = n + inverse.reshape(len(ids), len(columns))
            for s in range(len(table["slices"])):
                dynamic_spans.append((table, table_keys, n, len(keys)))
                keys.extend(self.store.row_keys(table["key"], table_keys, s))
                slots.append(self.store.row_slots(table["key"], table_keys, s))
            n += len(table_keys)
        left = self.deadline_s - (time.monotonic() - start)
        if left <= 0:
            raise TimeoutError(f"Predictor: the deadline of {self.deadline_s} s passed "
                               "before the rows were requested")
        values = self.store.get(keys, deadline_s=left,
                                slots=np.concatenate(slots) if slots else None)
        self.stats["keys_fetched"] += len(keys)
        self.stats["rows_fetched"] += n
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
                    mine = None
                    part = chunk
                else:
                    mine = np.flatnonzero(members[at_which])
                    if not len(mine):
                        continue
                    part = [chunk[i] for i in mine.tolist()]
                decoded = decode(part, b - a, precision)
                if taken is None and mine is None:
                    rows[:len(decoded), a:b] = decoded
                else:
                    at = np.arange(len(at_which)) if taken is None else taken
                    rows[at if mine is None else at[mine], a:b] = decoded
        for table, table_keys, first_row, first in dynamic_spans:
            self._dynamic_rows(table, table_keys, values[first:first + len(table_keys)],
                               rows[first_row:first_row + len(table_keys)])
        return rows, positions

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
