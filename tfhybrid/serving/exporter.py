"""``export``: a trained model as a stock SavedModel plus tables in a Redis Cluster.

Called on every rank of the mesh the model trained on. Each ``DistributedEmbedding`` of
the model is replaced, in a copy that shares every other layer, by ``ServedTables``:
plain TensorFlow lookups of whole tables, so the SavedModel that rank 0 writes loads in
any TensorFlow process (no tfhybrid, no Horovod). A copy is made by
``tf.keras.models.clone_model`` for a functional model; a subclassed model gives its own
through ``model.serving_twin(replacements)`` (``{DistributedEmbedding: ServedTables}``
in, a model that calls the replacements out), as the app's DLRM and DCN-v2 do.

External tables never pass through one host: each rank writes the shards it holds into
the store (a row-wise or table-wise shard by the first replica of its owner, a column
slice under its own slice key, a replicated table by rank 0), then every rank waits for
all the others, so that when ``export`` returns the store holds every row.

Example (one process; under horovodrun every rank runs the same; ``store`` is a
``tfhybrid.serving.RedisStore`` for external tables)::

    import tempfile
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding
    from tfhybrid.serving import export
    tfhybrid.init(model_parallel=1)
    ids = tf.keras.Input([2], dtype=tf.int32, name="ids")
    (vector,) = DistributedEmbedding([tf.keras.layers.Embedding(50, 4)])([ids])
    model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(vector)))
    path = export(model, tempfile.mkdtemp())
    loaded = tf.saved_model.load(path)
    out = loaded.signatures["serving_default"](ids=tf.constant([[1, 2]]))
    assert out["output"].shape == (1, 1)
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable, Mapping

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals, collectives, roles
from tfhybrid import mesh as mesh_lib
from tfhybrid.distributed import sync_replicas
from tfhybrid.layers.distributed_embedding import DistributedEmbedding
from tfhybrid.plan.types import Kind
from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.serving.inputs import ServedInputs
from tfhybrid.serving.rows import check_precision, encode_matrix, value_bytes
from tfhybrid.serving.served_copy import (ServedTables, id_columns, id_sources,
                                          tracing_mode)
from tfhybrid.serving.store import RedisStore

# rows written per store request while exporting (a bounded slice of a shard in memory)
EXPORT_CHUNK_ROWS = 65536


def held_entries(table_store: Any) -> tuple[np.ndarray, np.ndarray]:
    """(keys int64 [n], rows float32 [n, width]) a dynamic table's shard holds, by key."""
    # the table whose rows the shard's variable is, as checkpoints by key find it
    table = roles.role_of(table_store.variable).table
    live = np.asarray(table.slot_seen) >= 0
    keys = np.asarray(table.slot_keys)[live]
    order = np.argsort(keys, kind="stable")
    return keys[order], np.asarray(table.rows, np.float32)[live][order]


class _Served(tf.Module):
    """What a version folder saves: the variables the signatures read, the signatures."""

    def __init__(self, variables: list, functions: dict):
        super().__init__(name="served")
        self.variables_saved = variables
        self.functions = dict(functions)


def de_layers(model: tf.keras.Model) -> list[DistributedEmbedding]:
    """The model's ``DistributedEmbedding`` layers, nested ones too, in Keras' order."""
    return [layer for layer in _tf_internals.layers_in(model)
            if isinstance(layer, DistributedEmbedding)]


def _per_table(value: Any, names: list[str], what: str, allowed: tuple) -> dict[str, str]:
    """``value`` (one choice, or {table name: choice}) as a choice per table name."""
    if isinstance(value, str):
        value = {n: value for n in names}
    value = dict(value)
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{what} names tables {unknown} that the model does not have "
                         f"({sorted(names)})")
    out = {}
    for n in names:
        choice = value.get(n, allowed[0])
        if choice not in allowed:
            raise ValueError(f"{what}[{n!r}]={choice!r} is not one of {allowed}")
        out[n] = choice
    return out


class ExportPlan:
    """Which tables of which layers are external, their precision, slices and writers.

    Plain data from the layers' plans, the same on every rank; ``writes(layer)`` lists
    what this rank writes.
    """

    def __init__(self, model: tf.keras.Model, tables: Any, precision: Any):
        self.layers = de_layers(model)
        if not self.layers:
            raise ValueError("export: the model has no DistributedEmbedding layer")
        for layer in self.layers:
            if not layer.built or layer.plan is None:
                raise ValueError(f"export: DistributedEmbedding {layer.name!r} is not built "
                                 "(call the model on a batch first)")
        names = [manifest_lib.table_key(layer.name, spec.name)
                 for layer in self.layers for spec in layer.table_specs]
        short = {manifest_lib.table_key(layer.name, spec.name): spec.name
                 for layer in self.layers for spec in layer.table_specs}
        # a choice per table may name it by its own name or as "{layer}.{table}"
        def expand(value: Any) -> Any:
            if isinstance(value, str):
                return value
            full = {}
            for key, choice in dict(value).items():
                matches = [n for n in names if n == key or short[n] == key]
                if not matches:
                    raise ValueError(f"export: no table named {key!r} ({sorted(short.values())})")
                full.update({n: choice for n in matches})
            return full
        self.where = _per_table(expand(tables), names, "tables", ("inline", "external"))
        self.precision = _per_table(expand(precision), names, "precision",
                                    ("float32", "float16", "int8"))
        for layer in self.layers:
            for spec in layer.table_specs:
                key = manifest_lib.table_key(layer.name, spec.name)
                check_precision(self.precision[key])
                if self.where[key] == "inline" and self.precision[key] != "float32":
                    raise ValueError(f"export: table {key!r} is inline; precision "
                                     f"{self.precision[key]!r} applies to external tables only")

    @staticmethod
    def dynamic(layer: DistributedEmbedding, t: int) -> tuple[str, tuple] | None:
        """A dynamic table's (key dtype, default row), None for a table of fixed rows."""
        spec = layer.table_specs[t]
        if spec.keyed is None:
            return None
        default = spec.keyed.default_row
        return spec.keyed.key_dtype, tuple(default) if default is not None else (
            (0.0,) * spec.dim)

    def external(self, layer: DistributedEmbedding, t: int) -> bool:
        return self.where[manifest_lib.table_key(layer.name, layer.table_specs[t].name)] \
            == "external"

    @staticmethod
    def slices(layer: DistributedEmbedding, t: int) -> list[tuple[int, int]]:
        """Table t's column slices, by column (one for a table that is not sliced)."""
        return sorted({(s.col_start, s.col_end) for s in layer.plan.tables[t].shards})

    def writes(self, layer: DistributedEmbedding, mesh: mesh_lib.Mesh,
               everything: bool = False) -> list[tuple]:
        """(table, shard, store) of the external shards this rank writes (with
        ``everything``: of every table)."""
        out = []
        for t, placement in enumerate(layer.plan.tables):
            if not (everything or self.external(layer, t)):
                continue
            if placement.kind == Kind.DATA_PARALLEL:
                # every rank holds it: the first writes it, once
                if mesh.rank == 0:
                    out.append((t, placement.shards[0], layer.stores.get(t, 0)))
                continue
            for s, shard in enumerate(placement.shards):
                store = layer.stores.get(t, s)
                if store is not None and mesh.replica == 0:
                    out.append((t, shard, store))
        return out

    def description_layers(self, version: int, key_prefix: str | None) -> list:
        return self.describe(version, key_prefix, {})["layers"]

    def describe(self, version: int, key_prefix: str | None, inputs: dict) -> dict:
        """The manifest (``tfhybrid.serving.manifest``)."""
        layers = []
        for layer in self.layers:
            tables = []
            for t, spec in enumerate(layer.table_specs):
                key = manifest_lib.table_key(layer.name, spec.name)
                tables.append({
                    "key": key, "rows": int(spec.rows), "dim": int(spec.dim),
                    "combiner": spec.combiner, "external": self.where[key] == "external",
                    "precision": self.precision[key],
                    "slices": [list(s) for s in self.slices(layer, t)],
                    "value_bytes": [value_bytes(b - a, self.precision[key])
                                    for a, b in self.slices(layer, t)]})
                dynamic = self.dynamic(layer, t)
                if dynamic is not None:
                    # rows: the capacity; a key it does not hold reads default_row
                    tables[-1]["dynamic"] = {"key_dtype": dynamic[0],
                                             "default_row": list(dynamic[1])}
            layers.append({"name": layer.name, "tables": tables,
                           "features": [{"key": manifest_lib.feature_key(layer.name, f),
                                         "table": t} for f, t in
                                        enumerate(layer.input_table_map)]})
        return {"version": version, "key_prefix": key_prefix, "inputs": inputs,
                "layers": layers}


def agree(failed: bool, name: str, counts: tuple = ()) -> list[int]:
    """Every rank waits for every other; all raise if one of them failed. Returns
    ``counts`` summed over the ranks."""
    status = collectives.allreduce(
        tf.constant([1.0 if failed else 0.0] + [float(c) for c in counts], tf.float64),
        hvd.Sum, name).numpy()
    if status[0] > 0 and not failed:
        raise RuntimeError(f"export: {int(status[0])} other ranks failed at {name} "
                           "(their output names why)")
    return [int(c) for c in status[1:]]


def write_external_rows(plan: ExportPlan, store: RedisStore, mesh: mesh_lib.Mesh,
                        changed: Callable[..., np.ndarray] | None = None,
                        evicted: Callable[[str, Any, np.ndarray], np.ndarray] | None = None
                        ) -> dict[str, int]:
    """Writes this rank's external shards into ``store``; ``changed(table_key, shard,
    start, rows, keys=None)`` picks the rows to write (a bool mask; all rows without it):
    a fixed table's chunk from row ``start`` of the shard, a dynamic table's held
    ``keys`` (``start`` None); ``evicted(table_key, shard, keys)``: the keys of a dynamic
    shard to delete from the store (keys it held before, not now). Returns rows, bytes
    and deleted keys, by this rank and by all, and this rank's seconds. Collective:
    every rank calls it, all raise if one failed."""
    written = {"rows": 0, "bytes": 0, "deleted": 0, "seconds": 0.0}
    begin = time.perf_counter()
    error: BaseException | None = None
    try:
        for layer in plan.layers:
            for t, shard, table_store in plan.writes(layer, mesh):
                key = manifest_lib.table_key(layer.name, layer.table_specs[t].name)
                slice_index = plan.slices(layer, t).index((shard.col_start, shard.col_end))
                precision = plan.precision[key]
                width = shard.col_end - shard.col_start

                def put(ids: np.ndarray, rows: np.ndarray) -> None:
                    for first in range(0, len(ids), EXPORT_CHUNK_ROWS):
                        part = slice(first, first + EXPORT_CHUNK_ROWS)
                        store.put_rows(key, ids[part], encode_matrix(rows[part], precision),
                                       slice_index)
                    written["rows"] += len(ids)
                    written["bytes"] += len(ids) * value_bytes(width, precision)

                if plan.dynamic(layer, t) is not None:
                    # a dynamic shard: its held keys, each under its own key
                    keys, rows = held_entries(table_store)
                    if evicted is not None:
                        gone = evicted(key, shard, keys)
                        if len(gone):
                            written["deleted"] += store.delete(
                                store.row_keys(key, gone, slice_index),
                                slots=store.row_slots(key, gone, slice_index))
                    if changed is not None:
                        mask = changed(key, shard, None, rows, keys=keys)
                        keys, rows = keys[mask], rows[mask]
                    put(keys, rows)
                    continue
                for start in range(0, shard.row_end - shard.row_start, EXPORT_CHUNK_ROWS):
                    stop = min(shard.row_end - shard.row_start, start + EXPORT_CHUNK_ROWS)
                    rows = np.asarray(table_store.read_rows(start, stop), np.float32)
                    ids = np.arange(shard.row_start + start, shard.row_start + stop)
                    if changed is not None:
                        mask = changed(key, shard, start, rows)
                        rows, ids = rows[mask], ids[mask]
                    if len(ids):
                        put(ids, rows)
    except BaseException as e:  # every rank must reach the agreement below
        error = e
    written["seconds"] = time.perf_counter() - begin
    if error is not None:
        agree(True, "tfhybrid_serving_rows")
        raise error
    written["rows_all_ranks"], written["bytes_all_ranks"], written["deleted_all_ranks"] = \
        agree(False, "tfhybrid_serving_rows",
              (written["rows"], written["bytes"], written["deleted"]))
    return written


def _twin(model: tf.keras.Model, replacements: dict) -> Any:
    """A copy of ``model`` with each DistributedEmbedding replaced, other layers shared."""
    twin_of = getattr(model, "serving_twin", None)
    if callable(twin_of):
        return twin_of(replacements)
    by_id = {id(layer): served for layer, served in replacements.items()}
    if not getattr(model, "inputs", None):
        raise ValueError(f"export: model {model.name!r} is subclassed; give it a "
                         "serving_twin(replacements) method (docs/serving.md) or build it "
                         "with the functional API")
    # a new, uncompiled model over the same graph: cloning a compiled one would compile
    # the copy too (Keras 3), which needs the optimizer's class registered
    graph = tf.keras.Model(model.input, model.output)
    return tf.keras.models.clone_model(graph, clone_function=lambda layer: by_id.get(
        id(layer), layer))


def _as_outputs(result: Any, outputs: Callable | None) -> dict:
    if outputs is not None:
        result = outputs(result)
    if isinstance(result, dict):
        return dict(result)
    if isinstance(result, (list, tuple)):
        return {f"output_{i}": r for i, r in enumerate(result)}
    return {"output": result}


class SavedModelWriter:
    """Rank 0's side of an export: the twin, its traced signatures, and version folders.

    Made once and kept by ``PublishDeltas``, so a new version re-traces nothing: it
    writes the inline tables' and dense layers' current values.
    """

    def __init__(self, model: tf.keras.Model, plan: ExportPlan, input_signature: Any,
                 outputs: Callable | None, inline_tables: dict):
        self.plan = plan
        self.served = {}
        for layer in plan.layers:
            features = [(t, layer.table_specs[t].combiner, layer.table_specs[t].dim,
                         plan.external(layer, t)) for t in layer.input_table_map]
            dynamic = {t: (layer.table_specs[t], plan.dynamic(layer, t)[1])
                       for t in range(len(layer.table_specs))
                       if plan.dynamic(layer, t) is not None}
            self.served[layer] = ServedTables(layer.name, inline_tables[layer.name],
                                              features, layer.compute_dtype, dynamic)
        self.twin = _twin(model, self.served)
        self.inputs = ServedInputs(model, input_signature)
        twin, served_inputs, specs = self.twin, self.inputs, self.inputs.specs

        @tf.function(input_signature=[specs])
        def serve(flat):
            with tracing_mode("inline", {}):
                return _as_outputs(twin(served_inputs.structured(flat), training=False),
                                   outputs)

        @tf.function(input_signature=[specs])
        def ids_by_feature(flat):
            found: dict = {}
            with tracing_mode("ids", found):
                twin(served_inputs.structured(flat), training=False)
            return found

        functions = {manifest_lib.INLINE_SIGNATURE: serve}
        self.columns: dict[str, tuple[int, int, list[int]]] = {}
        self.ragged_keys: list[str] = []
        self.id_sources: dict[str, dict] | None = None
        self.row_width = 0
        if any(plan.where[k] == "external" for k in plan.where):
            traced = ids_by_feature.get_concrete_function()
            found = traced.structured_outputs
            order = [manifest_lib.feature_key(layer.name, f) for layer in plan.layers
                     for f in range(len(layer.input_table_map)) if
                     manifest_lib.feature_key(layer.name, f) in found]
            ragged_keys = [k for k in order if isinstance(found[k], tf.RaggedTensor)]
            for key in ragged_keys:
                if found[key].ragged_rank != 1 or found[key].shape.rank != 2:
                    raise ValueError(f"export: feature {key} looks up ragged ids of shape "
                                     f"{found[key].shape}; a served ragged feature is "
                                     "[batch, None]")
            columns = id_columns({k: found[k].shape for k in order if k not in ragged_keys})
            self.columns, self.ragged_keys = columns, ragged_keys
            self.id_sources = id_sources(traced, list(columns), ragged_keys)
            self.row_width = max(feature[2] for served in self.served.values()
                                 for feature in served.features if feature[3])
            for name in (manifest_lib.ROWS_INPUT, manifest_lib.POSITIONS_INPUT):
                if any(n == name or n.startswith(name + ".") for n in specs):
                    raise ValueError(f"export: the model has an input named {name!r}, the "
                                     "name external_rows gives the looked-up rows; rename it")
            width = self.row_width
            total = max((stop for _, stop, _ in columns.values()), default=0)

            @tf.function(input_signature=[specs])
            def feature_ids(flat):
                found = ids_by_feature(flat)
                dense = [tf.reshape(found[k], [-1, stop - start])
                         for k, (start, stop, _) in columns.items()]
                ids = {manifest_lib.ragged_ids_output(k): found[k].values
                       for k in ragged_keys}
                ids[manifest_lib.IDS_OUTPUT] = tf.concat(dense, axis=1) if dense else \
                    tf.zeros(tf.stack([found[ragged_keys[0]].nrows(), 0]), tf.int64)
                return ids

            ragged_specs = {k: tf.TensorSpec([None], tf.int32,
                                             name=manifest_lib.ragged_positions_input(k))
                            for k in ragged_keys}

            @tf.function(input_signature=[
                specs, tf.TensorSpec([None, width], tf.float32, name=manifest_lib.ROWS_INPUT),
                tf.TensorSpec([None, total], tf.int32, name=manifest_lib.POSITIONS_INPUT),
                ragged_specs])
            def external_rows(flat, rows, positions, ragged_positions):
                # one gather of every dense feature's rows, split by feature: a gather
                # per feature was twice the ops of the inline lookups
                pieces = dict(zip(columns, tf.split(
                    tf.gather(rows, positions),
                    [stop - start for start, stop, _ in columns.values()], axis=1))
                ) if columns else {}
                with tracing_mode("external", {"rows": rows, "pieces": pieces,
                                               "columns": columns, "row_width": width,
                                               "ragged": ragged_positions}):
                    return _as_outputs(twin(served_inputs.structured(flat), training=False),
                                       outputs)

            functions[manifest_lib.IDS_SIGNATURE] = feature_ids
            functions[manifest_lib.EXTERNAL_SIGNATURE] = external_rows
        self.functions = functions
        variables = [_tf_internals.tf_variable(v) for v in self.twin.weights]
        for served in self.served.values():
            variables.extend(served.table_variables.values())
            variables.extend(served.key_variables.values())
        self.module = _Served(variables, functions)

    def update_inline(self, inline_tables: dict) -> bool:
        """Writes new values of the inline tables; False if it cannot (a dynamic table's
        held keys change in number, its variables' shapes with them): make a new writer
        then."""
        inline = {layer: [t for t in inline_tables[layer.name]
                          if not self.plan.external(layer, t)] for layer in self.served}
        if any(t in served.keyed_tables for layer, served in self.served.items()
               for t in inline[layer]):
            return False
        for layer, served in self.served.items():
            for t in inline[layer]:
                served.table_variables[t].assign(inline_tables[layer.name][t])
        return True

    def write(self, directory: str, version: int, key_prefix: str | None,
              versioned: bool = True) -> str:
        """Writes version ``version`` (a temporary folder renamed into place: a reader
        never sees half a version); not ``versioned``: ``directory`` itself."""
        directory = os.path.abspath(directory)
        final = os.path.join(directory, str(version)) if versioned else directory
        partial = (os.path.join(directory, f".{version}.partial") if versioned
                   else directory.rstrip("/") + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.dirname(partial), exist_ok=True)
        signatures = {name: fn for name, fn in self.functions.items()}
        tf.saved_model.save(self.module, partial, signatures=signatures)
        description = self.plan.describe(version, key_prefix, self.inputs.description)
        description["id_columns"] = {k: [a, b] for k, (a, b, _) in self.columns.items()}
        description["row_width"] = self.row_width
        description["id_sources"] = self.id_sources
        description["ragged_features"] = self.ragged_keys
        manifest_lib.write(partial, description)
        if not versioned:
            shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        return final


def inline_values(plan: ExportPlan, mesh: mesh_lib.Mesh, everything: bool) -> dict:
    """{layer name: {table: whole values}} on rank 0: every table with ``everything``
    (the all-inline signature needs them), else the inline ones; a dynamic table's as
    (keys, rows), a table left out as an empty stand-in (``serving_default`` then reads
    zeros, or a dynamic table's default row, for it). Other ranks get stand-ins of every
    table. Collective."""
    out = {}
    for layer in plan.layers:
        wanted = [t for t in range(len(layer.table_specs))
                  if everything or not plan.external(layer, t)]
        fixed = [t for t in wanted if plan.dynamic(layer, t) is None]
        # the shards' rows travel over the model group to rank 0 (others get [])
        out[layer.name] = dict(zip(fixed, layer.get_weights(tables=fixed)))
        for t in wanted:
            if plan.dynamic(layer, t) is not None:
                out[layer.name][t] = _gathered_entries(plan, layer, t, mesh)
        if mesh.rank != 0:
            out[layer.name] = {}
        for t, spec in enumerate(layer.table_specs):
            if t not in out[layer.name]:
                out[layer.name][t] = ((np.zeros([0], np.int64), np.zeros([0, spec.dim]))
                                      if plan.dynamic(layer, t) is not None
                                      else np.zeros([1, spec.dim], np.float32))
    return out


def _gathered_entries(plan: ExportPlan, layer: DistributedEmbedding, t: int,
                      mesh: mesh_lib.Mesh) -> tuple[np.ndarray, np.ndarray]:
    """A dynamic table's (keys, rows), every shard's, on every rank (each shard from the
    first replica of its owner). Collective: sums over the ranks, each rank's entries at
    its own offset and zeros elsewhere, so the sums are the entries exactly."""
    dim = layer.table_specs[t].dim
    keys, rows = np.zeros([0], np.int64), np.zeros([0, dim], np.float32)
    for _, _, table_store in [w for w in plan.writes(layer, mesh, everything=True)
                              if w[0] == t]:
        keys, rows = held_entries(table_store)
    name = f"tfhybrid_serving_{layer.name}_{t}"
    counts = np.zeros([mesh.size], np.int64)
    counts[mesh.rank] = len(keys)
    counts = collectives.allreduce(tf.constant(counts), hvd.Sum, name + "_counts").numpy()
    start = int(counts[:mesh.rank].sum())
    all_keys = np.zeros([int(counts.sum())], np.int64)
    all_rows = np.zeros([int(counts.sum()), dim], np.float32)
    all_keys[start:start + len(keys)] = keys
    all_rows[start:start + len(keys)] = rows
    return (collectives.allreduce(tf.constant(all_keys), hvd.Sum, name + "_keys").numpy(),
            collectives.allreduce(tf.constant(all_rows), hvd.Sum, name + "_rows").numpy())


def check_store(store: RedisStore, mesh: mesh_lib.Mesh) -> None:
    """Rank 0 checks the store's settings; every rank raises if they are refused (a rank
    that went on alone would wait for the others forever)."""
    error: BaseException | None = None
    if mesh.rank == 0:
        try:
            store.check_settings()
        except BaseException as e:  # every rank must reach the agreement below
            error = e
    agree(error is not None, "tfhybrid_serving_settings")
    if error is not None:
        raise error


def write_metadata(plan: ExportPlan, store: RedisStore, version: int) -> None:
    """Writes each external table's manifest entry beside its rows (rank 0)."""
    for layer in plan.description_layers(version, store.key_prefix):
        for entry in layer["tables"]:
            if entry["external"]:
                store.put_json(store.meta_key(entry["key"]), dict(entry, version=version))


def next_version(directory: str) -> int:
    """One past the newest version folder of ``directory`` (1 for the first)."""
    return max(manifest_lib.version_folders(directory), default=0) + 1


def export(model: tf.keras.Model, directory: str, store: RedisStore | None = None,
           tables: str | Mapping[str, str] = "inline",
           precision: str | Mapping[str, str] = "float32",
           input_signature: Any = None, outputs: Callable | None = None,
           full_copy: bool = True, versioned: bool = True) -> str | None:
    """Exports ``model`` for serving; every rank of the mesh calls it.

    Args:
      model: a built Keras model with ``DistributedEmbedding`` layers (functional, or
        with a ``serving_twin`` method).
      directory: the base folder; the export is its next numbered version folder.
      store: the ``RedisStore`` of external tables (needed if any table is external).
      tables: ``"inline"``, ``"external"``, or per table ``{name: "inline" |
        "external"}`` (names as ``"table"`` or ``"layer.table"``; unnamed tables inline).
      precision: ``"float32"``, ``"float16"`` or ``"int8"`` (row-wise), or per table;
        applies to external tables.
      input_signature: the model's inputs as named ``tf.TensorSpec`` (read from a
        functional model's inputs when None).
      outputs: maps the model's output to the signatures' outputs (a dict of tensors);
        by default ``{"output": y}``.
      full_copy: ``serving_default`` holds every table, gathered on rank 0 (for models
        that fit one host); with False, rank 0 gathers only the inline tables and
        ``serving_default`` leaves the external ones at zero rows — serve through the
        ``Predictor`` then.
      versioned: write the next numbered version folder of ``directory`` (what
        TensorFlow Serving and ``Predictor`` watch); False: ``directory`` itself, replaced.

    Returns the version folder on rank 0, None on the others.
    """
    mesh = mesh_lib.current_mesh()
    plan = ExportPlan(model, tables, precision)
    external = any(choice == "external" for choice in plan.where.values())
    if external and store is None:
        raise ValueError("export: tables are external but store=None; pass a RedisStore")
    if external:
        check_store(store, mesh)
    if any(layer.replica_sync == "weights" for layer in plan.layers):
        # replicas drift between syncs: serve their average, as training will next
        sync_replicas(model)
    if external:
        write_external_rows(plan, store, mesh)
    values = inline_values(plan, mesh, full_copy)
    result = None
    error: BaseException | None = None
    try:
        # every rank makes the served copy (rank 0 alone writes it): making it alone
        # leaves rank 0's Keras state apart, and a model with a dynamic table built
        # afterwards would not train in step with the other ranks
        writer = SavedModelWriter(model, plan, input_signature, outputs, values)
        if mesh.rank == 0:
            version = next_version(directory) if versioned else 1
            if external:
                write_metadata(plan, store, version)
            result = writer.write(directory, version, store.key_prefix if store else None,
                                  versioned)
    except BaseException as e:  # every rank must reach the agreement below
        error = e
    agree(error is not None, "tfhybrid_serving_saved_model")
    if error is not None:
        raise error
    return result
