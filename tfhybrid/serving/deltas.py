"""``PublishDeltas``: fresh served models while training goes on.

Every ``every_steps`` steps every rank writes, of the external shards it writes (as
``export`` chooses them), only the rows that changed since the last publish (the first
publish writes every row), each row one whole value, acknowledged by the replicas
(``WAIT``); then rank 0 writes a new SavedModel version (dense layers and inline tables)
and removes versions beyond ``keep_versions``. Rows are updated in place, so while a
publish runs a request may combine rows of the new publish with the dense part of the
previous version; once the new version is written, a request sees that step's model.

To find changed rows each rank keeps a float32 copy of the external shards it writes
(their size again in host memory).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Mapping

import numpy as np
import tensorflow as tf

from tfhybrid import mesh as mesh_lib
from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.serving.exporter import (ExportPlan, SavedModelWriter, agree, check_store,
                                     inline_values, next_version, write_external_rows,
                                     write_metadata)
from tfhybrid.serving.store import RedisStore


class PublishDeltas(tf.keras.callbacks.Callback):
    """Publishes changed rows and a new SavedModel version every ``every_steps`` steps.

    Args:
      directory: the base folder of numbered versions (``Predictor`` serves the newest).
      store: the ``RedisStore`` of the external tables.
      every_steps: K, the training steps between publishes.
      tables, precision, input_signature, outputs: as ``tfhybrid.serving.export``'s.
      keep_versions: the newest versions kept; older ones are removed.

    ``history`` lists each publish: step, version, rows and bytes written and keys
    deleted (a dynamic table's evicted keys), all ranks.

    Example (one process; under horovodrun every rank runs the same)::

        import tempfile
        import numpy as np
        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding
        from tfhybrid.serving import PublishDeltas, RedisStore
        from tfhybrid.testing.redis_cluster import LocalRedisCluster
        tfhybrid.init(model_parallel=1)
        ids = tf.keras.Input([], dtype=tf.int32, name="ids")
        (vector,) = DistributedEmbedding([tf.keras.layers.Embedding(100, 4)])([ids])
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(vector))
        model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                      loss="mse")
        with LocalRedisCluster() as cluster:
            store = RedisStore(cluster.nodes, password=cluster.password)
            publish = PublishDeltas(tempfile.mkdtemp(), store, every_steps=2)
            model.fit(np.arange(8, dtype=np.int32), np.ones([8, 1]), batch_size=2,
                      verbose=0, callbacks=[publish])
            # steps 1-2 train ids 0-3, steps 3-4 ids 4-7: the first publish writes all
            # 100 rows, the second the 4 rows trained since
            assert [h["rows"] for h in publish.history] == [100, 4]
            store.close()
    """

    def __init__(self, directory: str, store: RedisStore, every_steps: int,
                 tables: str | Mapping[str, str] = "external",
                 precision: str | Mapping[str, str] = "float32",
                 input_signature: Any = None, outputs: Callable | None = None,
                 keep_versions: int = 3):
        super().__init__()
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps={every_steps!r} must be an int >= 1")
        if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) \
                or keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions!r} must be an int >= 1")
        self.directory = directory
        self.store = store
        self.every_steps = every_steps
        self.tables = tables
        self.precision = precision
        self.input_signature = input_signature
        self.outputs = outputs
        self.keep_versions = keep_versions
        self.history: list[dict] = []
        self._steps = 0
        self._plan: ExportPlan | None = None
        self._writer: SavedModelWriter | None = None
        self._published: dict[tuple, tuple] = {}

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._steps += 1
        if self._steps % self.every_steps == 0:
            self.publish()

    def _changed(self, key: str, shard: Any, start: int | None, rows: np.ndarray,
                 keys: np.ndarray | None = None) -> np.ndarray:
        """Rows of this chunk (or a dynamic shard's held ``keys``) that differ from the
        last publish, or were not in it (all at the first)."""
        where = (key, shard.row_start, shard.col_start, start)
        before = self._published.get(where)
        self._published[where] = (rows.copy(), None if keys is None else keys.copy())
        if before is None:
            return np.ones([len(rows)], bool)
        old_rows, old_keys = before
        if keys is None:
            return np.any(rows != old_rows, axis=1)
        # both sorted by key: a key held before compares with its row then
        at = np.minimum(np.searchsorted(old_keys, keys), max(len(old_keys) - 1, 0))
        held_before = (old_keys[at] == keys) if len(old_keys) else np.zeros(len(keys), bool)
        same = held_before.copy()
        same[held_before] = np.all(rows[held_before] == old_rows[at[held_before]], axis=1)
        return ~same

    def _evicted(self, key: str, shard: Any, keys: np.ndarray) -> np.ndarray:
        """Keys of a dynamic shard published before that it no longer holds."""
        before = self._published.get((key, shard.row_start, shard.col_start, None))
        if before is None:
            return np.zeros([0], np.int64)
        return np.setdiff1d(before[1], keys)

    def publish(self) -> dict:
        """Publishes now (every rank calls it); returns this publish's entry of history."""
        mesh = mesh_lib.current_mesh()
        if self._plan is None:
            self._plan = ExportPlan(self.model, self.tables, self.precision)
            check_store(self.store, mesh)
        plan = self._plan
        written = write_external_rows(plan, self.store, mesh, self._changed, self._evicted)
        values = inline_values(plan, mesh, everything=False)
        entry = {"step": self._steps, "rows": written["rows_all_ranks"],
                 "bytes": written["bytes_all_ranks"],
                 "deleted": written["deleted_all_ranks"], "version": None}
        error: BaseException | None = None
        try:
            # a functional copy shares the model's layers; a serving_twin copies their
            # weights when made, so it is made again (as is one whose inline dynamic
            # tables' keys changed). Every rank makes it, rank 0 writes it (as export)
            if self._writer is None or callable(getattr(
                    self.model, "serving_twin", None)) or not \
                    self._writer.update_inline(values):
                self._writer = SavedModelWriter(self.model, plan, self.input_signature,
                                                self.outputs, values)
            if mesh.rank == 0:
                version = next_version(self.directory)
                write_metadata(plan, self.store, version)
                self._writer.write(self.directory, version, self.store.key_prefix)
                entry["version"] = version
                self._prune()
        except BaseException as e:  # every rank must reach the agreement below
            error = e
        agree(error is not None, "tfhybrid_serving_publish")
        if error is not None:
            raise error
        self.history.append(entry)
        return entry

    def _prune(self) -> None:
        versions = manifest_lib.version_folders(self.directory)
        for old in versions[:-self.keep_versions]:
            shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
