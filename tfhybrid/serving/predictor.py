"""``Predictor``: raw inputs in, scores out, from an export and its store.

Per call: check the inputs against the export's (a ``ValueError`` names a missing,
extra or malformed input), run the SavedModel's ``feature_ids`` signature to get the ids
each external feature looks up, check them against their tables' rows, fetch every
distinct row (and column slice) of every external table in one ``RedisStore.get`` (one
pipelined request per Redis node, the nodes in parallel), dequantize, join slices,
combine each bag with its table's combiner, and run the ``external_rows`` signature.
A model without external tables runs ``serving_default`` directly.

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

from tfhybrid.combiners import COMBINERS, combined_bags
from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.serving.rows import decode
from tfhybrid.serving.store import RedisStore


def _combined(rows: np.ndarray, combiner: str, table_key: str) -> np.ndarray:
    """Bags of ``rows`` ([bags, hotness, width]) combined as in training: the one rule of
    ``tfhybrid.combiners`` (TensorFlow ops, no op library)."""
    if combiner not in COMBINERS:
        raise ValueError(f"table {table_key}: combiner {combiner!r} has no serving rule "
                         f"({COMBINERS})")
    lengths = tf.fill([rows.shape[0]], rows.shape[1])
    return combined_bags(tf.reduce_sum(tf.constant(rows), axis=1), combiner,
                         lengths).numpy()


class Predictor:
    """Serves an export of ``tfhybrid.serving.export`` with rows from ``store``.

    Args:
      saved_model_dir: the export's base folder (the newest version is served, and a
        newer one is picked up at the next call) or one version folder.
      store: the ``RedisStore`` of the external tables (None if every table is inline).
      deadline_s: each call's limit (fetching rows from every node included).

    ``stats`` counts calls and rows fetched. Calls are thread-safe.

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
        self.stats = {"calls": 0, "rows_fetched": 0, "keys_fetched": 0}
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
        tables, features = {}, []
        for layer in manifest["layers"]:
            for t, table in enumerate(layer["tables"]):
                tables[(layer["name"], t)] = table
            for feature in layer["features"]:
                table = tables[(layer["name"], feature["table"])]
                if table["external"]:
                    features.append((feature["key"], table))
        if features and self.store is None:
            raise ValueError(f"the export at {version_dir!r} has external tables; "
                             "Predictor needs store=RedisStore(...)")
        if features and manifest["key_prefix"] != self.store.key_prefix:
            raise ValueError(f"the export at {version_dir!r} wrote its rows under "
                             f"key_prefix={manifest['key_prefix']!r}; the store given has "
                             f"key_prefix={self.store.key_prefix!r}")
        with self._lock:
            self.manifest, self.loaded, self.features = manifest, loaded, features
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
            manifest, loaded, features = self.manifest, self.loaded, self.features
        checked = self._checked(inputs)
        tensors = {k: tf.constant(v) for k, v in checked.items()}
        self.stats["calls"] += 1
        if not features:
            out = loaded.signatures[manifest_lib.INLINE_SIGNATURE](**tensors)
            return {k: v.numpy() for k, v in out.items()}
        ids = {k: v.numpy() for k, v in
               loaded.signatures[manifest_lib.IDS_SIGNATURE](**tensors).items()}
        rows = self._rows(features, ids, start)
        feeds = dict(tensors)
        feeds.update({k: tf.constant(v) for k, v in rows.items()})
        out = loaded.signatures[manifest_lib.EXTERNAL_SIGNATURE](**feeds)
        return {k: v.numpy() for k, v in out.items()}

    predict = __call__

    def _rows(self, features: list, ids: dict, start: float) -> dict[str, np.ndarray]:
        """Each external feature's rows, combined: one store request for all tables."""
        wanted: dict[str, tuple[dict, np.ndarray]] = {}
        for key, table in features:
            feature_ids = ids[key]
            bad = feature_ids[(feature_ids < 0) | (feature_ids >= table["rows"])]
            if bad.size:
                raise ValueError(f"inputs: feature {key} (table {table['key']}) has ids "
                                 f"{sorted(set(bad.tolist()))[:5]} outside [0, "
                                 f"{table['rows']})")
            previous = wanted.get(table["key"], (table, np.zeros([0], np.int64)))[1]
            wanted[table["key"]] = (table, np.concatenate([previous, feature_ids.ravel()]))
        keys, spans, slots = [], [], []
        for name, (table, all_ids) in wanted.items():
            unique = np.unique(all_ids)
            for s, (a, b) in enumerate(table["slices"]):
                spans.append((name, table, unique, s, a, b, len(keys)))
                keys.extend(self.store.row_keys(name, unique, s))
                slots.append(self.store.row_slots(name, unique, s))
        left = self.deadline_s - (time.monotonic() - start)
        if left <= 0:
            raise TimeoutError(f"Predictor: the deadline of {self.deadline_s} s passed "
                               "before the rows were requested")
        values = self.store.get(keys, deadline_s=left, slots=np.concatenate(slots))
        self.stats["keys_fetched"] += len(keys)
        whole: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, table, unique, s, a, b, first in spans:
            chunk = values[first:first + len(unique)]
            missing = [keys[first + i].decode() for i, v in enumerate(chunk) if v is None]
            if missing:
                raise LookupError(f"Predictor: the store has no key {missing[:5]} "
                                  f"({len(missing)} missing) of table {name}: the export "
                                  "did not finish, or the store lost them")
            if name not in whole:
                whole[name] = (unique, np.empty([len(unique), table["dim"]], np.float32))
                self.stats["rows_fetched"] += len(unique)
            whole[name][1][:, a:b] = decode(chunk, b - a, table["precision"])
        out = {}
        for key, table in features:
            unique, table_rows = whole[table["key"]]
            feature_ids = ids[key]
            gathered = table_rows[np.searchsorted(unique, feature_ids)]
            combiner = table["combiner"]
            if combiner is not None and feature_ids.ndim == 2:
                gathered = _combined(gathered, combiner, table["key"])
            out[key] = gathered
        return out
