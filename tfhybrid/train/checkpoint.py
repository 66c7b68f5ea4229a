"""Sharded checkpoints that restore onto any mesh (reshard on load).

A checkpoint is a folder ``<directory>/ckpt-<step>`` of ``.npy`` files plus a JSON
``manifest.json``:

- every model-parallel shard of every ``DistributedEmbedding`` (and each of its optimizer
  slots) is written once, by the rank that owns it in replica 0 (in gradient-sync mode
  the other D-1 replicas hold identical copies; in ``replica_sync="weights"`` mode the
  copies may differ between syncs and replica 0's copy is what is saved: call
  ``tfhybrid.sync_replicas(model)`` first to save their average);
- dense variables, data-parallel tables, their slots and the optimizer's own state
  (``iterations``, loss-scale variables) are written by rank 0;
- the manifest holds the format version, the step, the mesh, each layer's
  ``ShardingPlan``, every file with its sha256, shape and dtype, the dense variables by
  path, and the optimizer's class and config.

Saving is atomic: all ranks write into ``<directory>/ckpt-<step>.tmp-<token>`` (the token
comes from rank 0), fsync their files, and agree over one allgather that every write
succeeded. Only then does rank 0 write the manifest and rename the folder to
``ckpt-<step>``, then point ``<directory>/latest`` at it (write + ``os.replace``). A crash
or a failed rank before that leaves the previous checkpoint and ``latest`` untouched; the
next successful save deletes the leftover ``.tmp-*`` folder and keeps the newest ``keep``
checkpoints. All ranks must see the same ``directory`` at the same path: one machine, or
a shared filesystem (NFS) across nodes; and one job saves into a directory at a time.

Restoring reads the manifest and, for every variable this rank holds under its CURRENT
plan, assembles the rows and columns from the overlapping saved shards (the saved and
the new shards are rectangles of the table), chunk by chunk from memory-mapped files.
So a checkpoint written on one mesh restores onto any other (2x2 -> 1x4, 4x1, 1x1, ...)
and a table may change between data-parallel and model-parallel placement. Tables come
back bit-identical. Optimizer slots follow their variable: full-shape slots
(``[rows, cols]``, e.g. Keras Adagrad, Adam, SGD momentum) reshard exactly like the table;
row-wise slots (``[rows]``, ``RowWiseAdagrad``'s accumulator) of a column-sliced table
hold the mean of g^2 over their slice's columns, so a new slice gets the column-count
weighted mean of the old slices it overlaps. That is exact when the column split is
unchanged or slices merge (into the whole table, say), and an approximation when a
table is split into different columns than it was saved with.

What is matched to what: dense variables by their place in the layer tree
(``"6.Dense/kernel"``: Keras renames layers per process, ``dense`` vs ``dense_1``, so names
would not match across model instances), ``DistributedEmbedding`` layers by place and
then by name, tables by their position in the layer (checked by shape), optimizer slots
by their name with the variable's name cut out (``{}/accumulator``, ``m/{}``). Restoring
needs the same architecture; any difference is a ``ValueError`` naming the variable.
Every variable is read and written in chunks of ``_CHUNK_BYTES`` (restoring maps the files
and reads only the rows it needs), so neither needs memory beyond the variables and a
chunk.

Public API::

    save(directory, model, optimizer, step, mesh=None, keep=3) -> str
    restore(directory_or_path, model, optimizer, mesh=None) -> int
    latest(directory) -> str | None
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import operator
import os
import re
import secrets
import shutil
import time
from typing import Any, Iterator

import numpy as np
import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import distributed
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers.distributed_embedding import DistributedEmbedding

__all__ = ["save", "restore", "latest", "FORMAT_VERSION"]

_LOG = logging.getLogger(__name__)

FORMAT = "tfhybrid-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"

# Variables are read and written this many bytes at a time, so saving or restoring a
# table needs at most one chunk of memory beyond the variables themselves.
_CHUNK_BYTES = 8 * 1024 * 1024
# Tests set this to a number of seconds: save then sleeps after its first file, so a
# test can kill the process in the middle of a save.
_PAUSE_ENV = "TFHYBRID_CHECKPOINT_TEST_PAUSE"

_COMMITTED = re.compile(r"^ckpt-(\d+)$")
_LEFTOVER = re.compile(r"^(ckpt-\d+|latest)\.tmp-")
# exception types a failing rank's error is re-raised as on every rank
_ERROR_TYPES = {cls.__name__: cls for cls in (
    FileNotFoundError, FileExistsError, PermissionError, OSError, ValueError, TypeError)}


# ------------------------------------------------------------------ public API
def save(directory: str, model: tf.keras.Model,
         optimizer: tf.keras.optimizers.Optimizer | None, step: int,
         mesh: mesh_lib.Mesh | None = None, keep: int = 3) -> str:
    """Writes a checkpoint of ``model`` (and ``optimizer``) as ``<directory>/ckpt-<step>``.

    Every rank must call it at the same time with the same ``directory`` and ``step``.
    Returns the checkpoint's path on every rank, after the checkpoint is committed. If any
    rank fails to write, every rank raises and the previous checkpoint stays the latest.
    The optimizer's slots are created first if it has none yet (they are saved with
    their initial values); ``optimizer=None`` saves the model alone.
    ``keep`` is the number of checkpoints kept (the newest saves; older ones are deleted).

    Example (one process)::

        import tempfile
        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding, Embedding
        from tfhybrid.train import checkpoint
        tfhybrid.init(model_parallel=1)
        ids = tf.keras.Input([2], dtype=tf.int64)
        pooled = DistributedEmbedding([Embedding(100, 4, combiner="sum")])(ids)[0]
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(pooled))
        path = checkpoint.save(tempfile.mkdtemp(), model, None, step=10)
        assert checkpoint.restore(path, model, None) == 10
    """
    try:
        # operator.index takes ints, numpy ints and integer scalar tensors, not floats
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise ValueError(f"step={step!r} must be an int >= 0") from None
    if step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be an int >= 1")
    _require_eager("save")
    mesh = mesh or mesh_lib.current_mesh()
    directory = os.path.abspath(directory)

    # 1. agree on the step, the folder and rank 0's token before touching the disk
    begin = _exchange(mesh, "tfhybrid_checkpoint_begin", {
        "step": step, "directory": directory,
        "token": secrets.token_hex(6) if mesh.rank == 0 else ""})
    if len({(r["step"], r["directory"]) for r in begin}) != 1:
        raise ValueError("checkpoint.save: ranks disagree on (step, directory): "
                         + ", ".join(f"rank {i}: ({r['step']}, {r['directory']!r})"
                                     for i, r in enumerate(begin)))
    token = begin[0]["token"]
    final = os.path.join(directory, f"ckpt-{step}")
    tmp = f"{final}.tmp-{token}"

    # 2. every rank writes its part; failures are reported, not raised, so that every
    # rank reaches the agreement below
    local_error: BaseException | None = None
    try:
        if optimizer is not None:
            # slots that do not exist yet are saved as the values they would start with
            _build_optimizer(optimizer, model)
        state = _collect(model, optimizer, mesh)
        os.makedirs(tmp, exist_ok=True)
        record = _write_rank_files(tmp, state, mesh)
        _fsync_dir(tmp)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error, record = e, _failure(e)
    written = _exchange(mesh, "tfhybrid_checkpoint_written", record)
    if any(not r["ok"] for r in written):
        if mesh.rank == 0:
            # every rank has stopped writing (it reached the allgather): safe to remove
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_failed(written, local_error, f"saving checkpoint step {step} to {tmp}")

    # 3. rank 0 commits: manifest, rename, latest pointer; then a barrier so no rank
    # returns before the checkpoint is visible
    local_error, commit = None, {"ok": True}
    if mesh.rank == 0:
        try:
            manifest = _manifest(step, state, optimizer, mesh, written)
            _commit(directory, tmp, final, manifest, token)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            local_error, commit = e, _failure(e)
    committed = _exchange(mesh, "tfhybrid_checkpoint_commit", commit)
    _raise_failed(committed, local_error, f"committing checkpoint {final}")
    if mesh.rank == 0:
        # only now, with the new checkpoint committed, may older ones go
        _clean_up(directory, keep, token)
    return final


def restore(directory_or_path: str, model: tf.keras.Model,
            optimizer: tf.keras.optimizers.Optimizer | None,
            mesh: mesh_lib.Mesh | None = None) -> int:
    """Loads a checkpoint into ``model`` (and ``optimizer``) on the current mesh; returns its step.

    ``directory_or_path`` is a checkpoint folder or a directory of them (its ``latest``
    is used). The mesh and the sharding plans may differ from the ones it was saved with.
    Every rank must call it; the model's ``DistributedEmbedding`` layers must be built.
    The optimizer's slots are created first if it has none yet; a checkpoint saved
    without an optimizer leaves the optimizer as it is. Raises
    ``FileNotFoundError`` when there is no checkpoint and ``ValueError`` for a corrupt
    file (naming it) or a model that does not match the checkpoint, on every rank.
    With a failing checksum nothing is assigned; other errors may leave the model
    partly restored.

    Example: see :func:`save`.
    """
    _require_eager("restore")
    mesh = mesh or mesh_lib.current_mesh()
    local_error, record, step = None, {"ok": True}, -1
    try:
        path = _resolve(directory_or_path)
        manifest = _read_manifest(path)
        if optimizer is not None:
            _build_optimizer(optimizer, model)
        state = _collect(model, optimizer, mesh)
        _restore_rank(path, manifest, state)
        step = int(manifest["step"])
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error, record = e, _failure(e)
    outcomes = _exchange(mesh, "tfhybrid_checkpoint_restore", record)
    _raise_failed(outcomes, local_error, f"restoring {directory_or_path!r}")
    return step


def latest(directory: str) -> str | None:
    """The newest committed checkpoint in ``directory``, or None if there is none.

    Follows the ``latest`` pointer; if it is missing or names no complete checkpoint,
    falls back to the most recently written ``ckpt-<step>`` with a manifest.

    Example::

        import tempfile
        from tfhybrid.train import checkpoint
        assert checkpoint.latest(tempfile.mkdtemp()) is None
    """
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        name = ""
    if _COMMITTED.match(name) and os.path.isfile(os.path.join(directory, name, MANIFEST)):
        return os.path.join(directory, name)
    found = _committed(directory)
    return os.path.join(directory, found[0][1]) if found else None


# ------------------------------------------------------------- model state
@dataclasses.dataclass
class _Target:
    """One variable of this rank that holds the rectangle ``rect`` of a table."""
    shard: int                          # index in the table's placement
    var: tf.Variable
    rect: tuple[int, int, int, int]     # row_start, row_end, col_start, col_end
    slots: dict[str, tf.Variable]


@dataclasses.dataclass
class _Layer:
    path: str
    layer: DistributedEmbedding
    targets: list[list[_Target]]        # per table


@dataclasses.dataclass
class _State:
    embeddings: list[_Layer]
    dense: dict[str, tuple[tf.Variable, dict[str, tf.Variable]]]
    optimizer_vars: dict[str, tf.Variable]   # iterations, loss scale, ...
    optimizer_class: str | None


def _collect(model: Any, optimizer: Any, mesh: mesh_lib.Mesh) -> _State:
    """Finds the embedding layers, the dense variables and their optimizer slots."""
    inner = _inner_optimizer(optimizer)
    embeddings: list[tuple[str, DistributedEmbedding]] = []
    dense: dict[str, tf.Variable] = {}
    seen: set[int] = set()
    _walk(model, "", embeddings, dense, seen)
    if not embeddings:
        raise ValueError(f"model {getattr(model, 'name', model)!r} contains no "
                         "DistributedEmbedding layer; use tf.train.Checkpoint for it")
    names = [layer.name for _, layer in embeddings]
    if len(set(names)) != len(names):
        raise ValueError(f"the model's DistributedEmbedding layers must have unique names "
                         f"(the manifest is keyed by them); got {names}")
    layer_vars: set[int] = set()
    layers = []
    for path, layer in embeddings:
        if layer.plan is None:
            raise ValueError(f"DistributedEmbedding {layer.name!r} is not built; call the "
                             "model on a batch (or build it) before save/restore")
        lm = layer._mesh
        if (lm.size, lm.rank, lm.model_parallel, lm.layout) != (
                mesh.size, mesh.rank, mesh.model_parallel, mesh.layout):
            raise ValueError(f"DistributedEmbedding {layer.name!r} was built on mesh "
                             f"{lm.shape} ({lm.layout}), not on the given mesh {mesh.shape} "
                             f"({mesh.layout})")
        layer_vars.update(id(v) for v in layer.weights)
        targets: list[list[_Target]] = []
        for t, placement in enumerate(layer.plan.tables):
            if placement.kind == "data_parallel":
                shard = placement.shards[0]
                pairs = [(0, layer._table_vars[t], shard)]
            else:
                pairs = [(s, layer._shard_vars[(t, s)], shard)
                         for s, shard in enumerate(placement.shards)
                         if (t, s) in layer._shard_vars]
            targets.append([_Target(s, var, (sh.row_start, sh.row_end, sh.col_start,
                                             sh.col_end), _slots(optimizer, var))
                            for s, var, sh in pairs])
        layers.append(_Layer(path, layer, targets))
    # variables the walk did not reach (no layer tracks them) still get a stable key
    for i, var in enumerate(model.weights):
        if id(var) not in seen and id(var) not in layer_vars:
            seen.add(id(var))
            dense[f"weights[{i}]"] = var
    dense_state = {path: (var, _slots(optimizer, var)) for path, var in dense.items()}
    return _State(layers, dense_state, _optimizer_vars(optimizer, inner, model),
                  None if inner is None else type(inner).__name__)


def _walk(module: Any, prefix: str, embeddings: list, dense: dict, seen: set) -> None:
    """Names variables by their place in the layer tree: ``<index>.<Class>/.../<leaf>``.

    Keras makes layer names unique per process (``dense``, ``dense_1``...), so a second
    model of the same architecture gets other names; the position in the tree is the
    same, like the keys ``tf.train.Checkpoint`` uses.
    """
    if isinstance(module, DistributedEmbedding):
        if all(layer is not module for _, layer in embeddings):   # a shared layer once
            embeddings.append((prefix.rstrip("/") or ".", module))
        return
    own = list(getattr(module, "_trainable_weights", [])) + list(
        getattr(module, "_non_trainable_weights", []))
    for var in own:
        if not isinstance(var, tf.Variable) or id(var) in seen:
            continue
        seen.add(id(var))
        leaf = var.name.split(":")[0].rsplit("/", 1)[-1]
        key, n = prefix + leaf, 1
        while key in dense:
            key, n = f"{prefix}{leaf}#{n}", n + 1
        dense[key] = var
    children = (module._flatten_layers(include_self=False, recursive=False)
                if hasattr(module, "_flatten_layers") else [])
    for i, child in enumerate(children):
        _walk(child, f"{prefix}{i}.{type(child).__name__}/", embeddings, dense, seen)


def _inner_optimizer(optimizer: Any) -> Any:
    # a LossScaleOptimizer (tfhybrid.DistributedOptimizer under mixed_float16) keeps the
    # slots in the optimizer it wraps
    while optimizer is not None and hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _slots(optimizer: Any, var: tf.Variable) -> dict[str, tf.Variable]:
    """The optimizer slots of ``var``, keyed by their name with the variable's name cut out.

    The key is the same for every shard, mesh and model instance: ``m/{}`` for Adam's
    ``m/dense/kernel``, ``{}/accumulator`` for ``<var>/accumulator``. Name scopes in front
    are dropped: a slot made inside ``apply_gradients`` is ``Adam/m/dense/kernel``, one
    made by ``optimizer.build`` outside it ``m/dense/kernel``. The slots of a table come
    from the embedding optimizer when the optimizer has one.
    """
    if optimizer is None:
        return {}
    shared = var._shared_name
    pattern = re.compile(r"(^|/)" + re.escape(shared) + r"(/|$)")
    out: dict[str, tf.Variable] = {}
    for slot in distributed._optimizer_state_of(optimizer, var):
        name = slot.name.split(":")[0]
        match = pattern.search(name)
        if match is None:
            key = name
        else:
            prefix = name[:match.start()].strip("/")
            suffix = name[match.end():].strip("/")
            key = f"{{}}/{suffix}" if suffix else f"{prefix.rsplit('/', 1)[-1]}/{{}}"
        unique, n = key, 1
        while unique in out:
            unique, n = f"{key}#{n}", n + 1
        out[unique] = slot
    return out


def _optimizer_vars(optimizer: Any, inner: Any, model: Any) -> dict[str, tf.Variable]:
    """Optimizer variables that belong to no model variable: iterations, loss scale."""
    if inner is None:
        return {}
    slot_ids = {id(s) for v in model.weights for s in _slots(optimizer, v).values()}
    out = {}
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    for prefix, owner in (("", inner), ("embedding_optimizer/", embedding_optimizer)):
        if owner is None:
            continue
        variables = owner.variables() if callable(owner.variables) else owner.variables
        for var in variables:
            if id(var) not in slot_ids:
                out[prefix + var.name.split(":")[0]] = var
        out.setdefault(prefix + "iteration", owner.iterations)
    state = getattr(optimizer, "_loss_scale", None)
    if hasattr(state, "current_loss_scale"):
        out["loss_scale/current_loss_scale"] = state.current_loss_scale
        out["loss_scale/counter"] = state.counter
    return out


def _build_optimizer(optimizer: Any, model: Any) -> None:
    """Creates the optimizer's slots for the model's variables if it has none yet (the
    embedding optimizer's for the tables, where there is one)."""
    variables = model.trainable_variables
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    owners = [(_inner_optimizer(optimizer), variables)]
    if embedding_optimizer is not None:
        owners = [(_inner_optimizer(optimizer),
                   [v for v in variables if not distributed.is_embedding(v)]),
                  (embedding_optimizer, [v for v in variables if distributed.is_embedding(v)])]
    for inner, owned in owners:
        if hasattr(inner, "get_slot_names"):   # legacy Keras optimizer
            if hasattr(inner, "_create_all_weights"):
                inner._create_all_weights(owned)
        elif not getattr(inner, "_built", False):
            inner.build(owned)


# ------------------------------------------------------------------ saving
def _write_rank_files(tmp: str, state: _State, mesh: mesh_lib.Mesh) -> dict:
    """Writes this rank's share; returns what it wrote for rank 0's manifest."""
    files: dict[str, dict] = {}
    shards, dense, opt = [], {}, {}
    pause = _Pause()

    def write(name: str, var: tf.Variable) -> str:
        files[name] = _write_npy(os.path.join(tmp, name), var)
        pause.after_file()
        return name

    def write_with_slots(stem: str, var: tf.Variable, slots: dict) -> tuple[str, dict]:
        main = write(f"{stem}.npy", var)
        return main, {key: write(f"{stem}-slot{k}.npy", slots[key])
                      for k, key in enumerate(sorted(slots))}

    for li, entry in enumerate(state.embeddings):
        for t, targets in enumerate(entry.targets):
            replicated = entry.layer.plan.tables[t].kind == "data_parallel"
            # one copy of each shard: rank 0 for replicated tables, replica 0's owner else
            if (mesh.rank != 0) if replicated else (mesh.replica != 0):
                continue
            for target in targets:
                main, slots = write_with_slots(f"e{li}-t{t}-s{target.shard}", target.var,
                                               target.slots)
                shards.append([li, t, target.shard, main, slots])
    if mesh.rank == 0:
        for i, (path, (var, slots)) in enumerate(state.dense.items()):
            dense[path] = write_with_slots(f"d{i}", var, slots)
        for i, (name, var) in enumerate(sorted(state.optimizer_vars.items())):
            opt[name] = write(f"o{i}.npy", var)
    return {"ok": True, "files": files, "shards": shards, "dense": dense, "optimizer": opt}


class _Pause:
    """The test hook: sleep once, after the first file, if ``_PAUSE_ENV`` is set."""

    def __init__(self):
        self._seconds = float(os.environ.get(_PAUSE_ENV, "0") or 0)

    def after_file(self) -> None:
        if self._seconds > 0:
            seconds, self._seconds = self._seconds, 0.0
            time.sleep(seconds)


def _numpy_dtype(var: tf.Variable) -> np.dtype:
    dtype = np.dtype(var.dtype.as_numpy_dtype)
    if dtype.kind not in "biuf":
        raise ValueError(f"variable {var.name!r} has dtype {var.dtype.name}, which a .npy "
                         "checkpoint cannot hold portably")
    return dtype.newbyteorder("<")


def _row_chunks(rows: int, row_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _write_npy(path: str, var: tf.Variable) -> dict:
    """Streams ``var`` into a .npy file chunk by chunk; returns its sha256, shape, dtype.

    Rows are read with ``tf.gather``: a dense read of a variable that saw sparse updates
    would copy the whole table first.
    """
    shape = tuple(int(d) for d in var.shape)
    dtype = _numpy_dtype(var)
    header = io.BytesIO()
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(header, fields)
    except ValueError:  # a header over 64 KiB needs format 2.0
        header = io.BytesIO()
        np.lib.format.write_array_header_2_0(header, fields)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        def put(data: bytes) -> None:
            digest.update(data)
            f.write(data)

        put(header.getvalue())
        if len(shape) == 0:
            put(np.asarray(var.numpy(), dtype).tobytes())
        else:
            width = math.prod(shape[1:])
            for start, stop in _row_chunks(shape[0], width * dtype.itemsize):
                chunk = tf.gather(var, tf.range(start, stop)).numpy()
                put(np.ascontiguousarray(chunk, dtype).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "shape": list(shape), "dtype": dtype.str,
            "bytes": os.path.getsize(path)}


def _manifest(step: int, state: _State, optimizer: Any, mesh: mesh_lib.Mesh,
              written: list[dict]) -> dict:
    files: dict[str, dict] = {}
    shard_files: dict[tuple[int, int, int], tuple[str, dict]] = {}
    dense: dict[str, dict] = {}
    opt_state: dict[str, str] = {}
    for record in written:
        files.update(record["files"])
        for li, t, s, main, slots in record["shards"]:
            shard_files[(li, t, s)] = (main, slots)
        for path, (main, slots) in record["dense"].items():
            dense[path] = {"file": main, "slots": slots}
        opt_state.update(record["optimizer"])
    embeddings = {}
    for li, entry in enumerate(state.embeddings):
        plan = entry.layer.plan
        tables = []
        for t, (table, placement) in enumerate(zip(entry.layer._tables, plan.tables)):
            shards = []
            for s, shard in enumerate(placement.shards):
                if (li, t, s) not in shard_files:
                    raise RuntimeError(f"no rank wrote shard {s} of table {table.name!r} "
                                       f"of layer {entry.layer.name!r}")
                main, slots = shard_files[(li, t, s)]
                shards.append({"rows": [shard.row_start, shard.row_end],
                               "cols": [shard.col_start, shard.col_end],
                               "file": main, "slots": slots})
            tables.append({"name": table.name, "rows": table.rows, "dim": table.dim,
                           "kind": placement.kind, "shards": shards})
        embeddings[entry.layer.name] = {"path": entry.path, "plan": json.loads(plan.to_json()),
                                        "tables": tables}
    inner = _inner_optimizer(optimizer)
    optimizer_entry = None
    if inner is not None:
        optimizer_entry = {
            "class": type(inner).__name__,
            "wrapper": None if inner is optimizer else type(optimizer).__name__,
            "config": json.loads(json.dumps(_config(optimizer), default=repr)),
            "iterations": int(inner.iterations.numpy()),
            "state": opt_state,
        }
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "step": step, "saved_at": time.time(),
        "mesh": {"size": mesh.size, "data_parallel": mesh.data_parallel,
                 "model_parallel": mesh.model_parallel, "layout": mesh.layout},
        "embeddings": embeddings, "dense": dense, "optimizer": optimizer_entry,
        "files": files,
    }


def _config(optimizer: Any) -> Any:
    try:
        return optimizer.get_config()
    except Exception as e:  # noqa: BLE001 - the config is informative only
        return f"<get_config failed: {e!r}>"


def _commit(directory: str, tmp: str, final: str, manifest: dict, token: str) -> None:
    """Rank 0: manifest into the folder, folder into place, then the latest pointer."""
    _write_durably(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    if os.path.exists(final):
        # saving a step again: move the old one aside (the clean-up deletes it); a
        # crash right here leaves `latest` to fall back to the previous checkpoint
        os.rename(final, f"{final}.tmp-replaced-{token}")
    os.rename(tmp, final)
    _fsync_dir(directory)
    pointer = os.path.join(directory, f"{LATEST}.tmp-{token}")
    _write_durably(pointer, os.path.basename(final) + "\n")
    os.replace(pointer, os.path.join(directory, LATEST))
    _fsync_dir(directory)


def _clean_up(directory: str, keep: int, token: str) -> None:
    """Rank 0, after a commit: drops leftovers of crashed saves and old checkpoints.

    Failures only warn: the new checkpoint is already committed.
    """
    try:
        for name in os.listdir(directory):
            if _LEFTOVER.match(name):
                _remove(os.path.join(directory, name))
        for _, name in _committed(directory)[keep:]:
            # rename first, so a crash mid-delete never leaves a half checkpoint that
            # still looks complete
            doomed = os.path.join(directory, f"{name}.tmp-deleting-{token}")
            os.rename(os.path.join(directory, name), doomed)
            _remove(doomed)
        _fsync_dir(directory)
    except OSError as e:
        _LOG.warning("checkpoint clean-up in %s failed: %r", directory, e)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _committed(directory: str) -> list[tuple[int, str]]:
    """(manifest mtime in ns, name) of complete checkpoints, newest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _COMMITTED.match(name)
        if not match:
            continue
        try:
            mtime = os.stat(os.path.join(directory, name, MANIFEST)).st_mtime_ns
        except OSError:
            continue
        found.append(((mtime, int(match.group(1))), name))
    found.sort(reverse=True)
    return [(key[0], name) for key, name in found]


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- restoring
def _resolve(directory_or_path: str) -> str:
    path = os.fspath(directory_or_path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path!r}: neither a {MANIFEST} nor "
                                    "a committed ckpt-<step> folder")
        return found
    raise FileNotFoundError(f"checkpoint path {path!r} does not exist")


def _read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint manifest {manifest_path!r} is corrupt: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path!r} is not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{manifest_path!r} has format version {manifest.get('version')!r}; "
                         f"this tfhybrid reads version {FORMAT_VERSION}")
    for key in ("step", "embeddings", "dense", "files", "optimizer"):
        if key not in manifest:
            raise ValueError(f"checkpoint manifest {manifest_path!r} has no {key!r} entry")
    return manifest


@dataclasses.dataclass
class _Saved:
    """One saved shard: its rectangle, its file and its slots' files."""
    rect: tuple[int, int, int, int]
    file: str
    slots: dict[str, str]


def _restore_rank(path: str, manifest: dict, state: _State) -> None:
    """Plans every assignment, verifies the files it needs, then assigns."""
    assignments: list[tuple[str, Any]] = []   # (kind, args) run after verification
    needed: set[str] = set()
    saved_layers = manifest["embeddings"]
    matched: set[str] = set()
    restore_slots = manifest["optimizer"] is not None

    if restore_slots and state.optimizer_class is not None:
        saved_class = manifest["optimizer"]["class"]
        if saved_class != state.optimizer_class:
            raise ValueError(f"checkpoint {path!r} holds the state of a {saved_class} "
                             f"optimizer; the optimizer given is a {state.optimizer_class}")

    for entry in state.embeddings:
        name = _match_layer(entry, saved_layers, matched, path)
        saved = saved_layers[name]
        tables = saved["tables"]
        layer_tables = entry.layer._tables
        if len(tables) != len(layer_tables):
            raise ValueError(f"DistributedEmbedding {entry.layer.name!r} has "
                             f"{len(layer_tables)} tables; checkpoint layer {name!r} has "
                             f"{len(tables)}")
        for t, (table, saved_table) in enumerate(zip(layer_tables, tables)):
            if (table.rows, table.dim) != (saved_table["rows"], saved_table["dim"]):
                raise ValueError(
                    f"table {t} ({table.name!r}) of layer {entry.layer.name!r} is "
                    f"{table.rows}x{table.dim}; the checkpoint's ({saved_table['name']!r}) "
                    f"is {saved_table['rows']}x{saved_table['dim']}")
            pieces = [_Saved((*sh["rows"], *sh["cols"]), sh["file"], sh["slots"])
                      for sh in saved_table["shards"]]
            _check_tiling(pieces, table.rows, table.dim, manifest, path, table.name)
            for target in entry.targets[t]:
                sources = [p for p in pieces if _overlap(p.rect, target.rect) is not None]
                pairs = [(target.var, None)]
                for key, slot in target.slots.items() if restore_slots else ():
                    missing = [p for p in sources if key not in p.slots]
                    if missing:
                        raise ValueError(
                            f"optimizer slot {key!r} of table {table.name!r} is not in "
                            f"checkpoint {path!r} (it has {sorted(missing[0].slots)})")
                    pairs.append((slot, key))
                for var, key in pairs:
                    rowwise = _is_rowwise(var, target.rect)
                    for p in sources:
                        name = p.file if key is None else p.slots[key]
                        _check_source(var, rowwise, p, name, manifest, path)
                        needed.add(name)
                    assignments.append(("table", (var, target.rect, sources, key, rowwise)))
    unmatched = sorted(set(saved_layers) - matched)
    if unmatched:
        raise ValueError(f"checkpoint {path!r} has DistributedEmbedding layer(s) {unmatched} "
                         "that the model does not have")

    saved_dense = manifest["dense"]
    for var_path, (var, slots) in state.dense.items():
        if var_path not in saved_dense:
            raise ValueError(f"variable {var_path!r} ({var.name}) of the model is not in "
                             f"checkpoint {path!r}; it has {sorted(saved_dense)[:20]}")
        entry = saved_dense[var_path]
        pairs = [(var, entry["file"], var_path)]
        for key, slot in slots.items() if restore_slots else ():
            if key not in entry["slots"]:
                raise ValueError(f"optimizer slot {key!r} of variable {var_path!r} is not "
                                 f"in checkpoint {path!r}")
            pairs.append((slot, entry["slots"][key], f"{var_path} {key}"))
        for target, name, what in pairs:
            _check_file_matches(target, name, what, manifest, path)
            needed.add(name)
            assignments.append(("dense", (target, name, what)))
    extra = sorted(set(saved_dense) - set(state.dense))
    if extra:
        raise ValueError(f"checkpoint {path!r} has variable(s) {extra[:20]} that the model "
                         "does not have")
    if restore_slots:
        saved_state = manifest["optimizer"]["state"]
        for name, var in state.optimizer_vars.items():
            if name in saved_state:
                _check_file_matches(var, saved_state[name], f"optimizer {name}", manifest, path)
                needed.add(saved_state[name])
                assignments.append(("dense", (var, saved_state[name], f"optimizer {name}")))

    reader = _Reader(path, manifest)
    for name in sorted(needed):
        reader.verify(name)
    for kind, args in assignments:
        if kind == "table":
            _assign_rect(reader, *args)
        else:
            _assign_dense(reader, *args)


def _check_file_matches(var: tf.Variable, name: str, what: str, manifest: dict,
                        path: str) -> None:
    """Shape and dtype from the manifest, so a mismatch fails before anything is assigned."""
    meta = manifest["files"].get(name)
    if meta is None:
        raise ValueError(f"checkpoint {path!r}: file {name!r} of {what!r} is not listed in "
                         "its manifest")
    if list(meta["shape"]) != var.shape.as_list() or np.dtype(meta["dtype"]) != _numpy_dtype(var):
        raise ValueError(f"variable {what!r} ({var.name}) is {var.dtype.name} "
                         f"{var.shape.as_list()}; checkpoint {path!r} holds "
                         f"{np.dtype(meta['dtype']).name} {meta['shape']} for it")


def _is_rowwise(var: tf.Variable, rect: tuple) -> bool:
    """Whether ``var`` (a shard of ``rect``, or a slot of one) is row-wise: ``[rows]``."""
    rows, width = rect[1] - rect[0], rect[3] - rect[2]
    shape = tuple(var.shape)
    if shape not in ((rows, width), (rows,)):
        raise ValueError(f"variable {var.name!r} has shape {list(shape)}; a table shard of "
                         f"{rows}x{width} (or an optimizer slot of it) must be "
                         f"[{rows}, {width}] or [{rows}]")
    return shape == (rows,)


def _check_source(var: tf.Variable, rowwise: bool, source: _Saved, name: str,
                  manifest: dict, path: str) -> None:
    """The saved piece ``name`` of ``source`` must have the layout and dtype of ``var``."""
    meta = manifest["files"].get(name)
    rows, width = source.rect[1] - source.rect[0], source.rect[3] - source.rect[2]
    want = [rows] if rowwise else [rows, width]
    if meta is None or list(meta["shape"]) != want or np.dtype(meta["dtype"]) != _numpy_dtype(var):
        held = "nothing" if meta is None else f"{np.dtype(meta['dtype']).name} {meta['shape']}"
        raise ValueError(f"checkpoint {path!r}: file {name!r} holds {held}; restoring "
                         f"{var.name!r} ({var.dtype.name}, {'row-wise' if rowwise else 'full'}) "
                         f"needs {want} for the saved shard {source.rect}")


def _match_layer(entry: _Layer, saved: dict, matched: set, path: str) -> str:
    """The checkpoint layer for ``entry``: same place in the model, else same name."""
    by_path = [n for n, e in saved.items() if e["path"] == entry.path and n not in matched]
    if len(by_path) == 1:
        name = by_path[0]
    elif entry.layer.name in saved and entry.layer.name not in matched:
        name = entry.layer.name
    else:
        raise ValueError(f"DistributedEmbedding {entry.layer.name!r} (at {entry.path!r}) "
                         f"has no match in checkpoint {path!r}, which has layers "
                         f"{ {n: e['path'] for n, e in saved.items()} }")
    matched.add(name)
    return name


def _check_tiling(pieces: list[_Saved], rows: int, dim: int, manifest: dict, path: str,
                  table: str) -> None:
    area = 0
    for p in pieces:
        r0, r1, c0, c1 = p.rect
        if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= dim):
            raise ValueError(f"checkpoint {path!r}: shard {p.rect} of table {table!r} lies "
                             f"outside its {rows}x{dim} shape")
        meta = manifest["files"].get(p.file)
        if meta is None or tuple(meta["shape"]) != (r1 - r0, c1 - c0):
            raise ValueError(f"checkpoint {path!r}: file {p.file!r} of table {table!r} "
                             f"does not hold the {r1 - r0}x{c1 - c0} shard {p.rect}")
        area += (r1 - r0) * (c1 - c0)
    if area != rows * dim:
        raise ValueError(f"checkpoint {path!r}: the shards of table {table!r} cover "
                         f"{area} of its {rows * dim} elements")


def _overlap(a: tuple, b: tuple) -> tuple[int, int, int, int] | None:
    r0, r1 = max(a[0], b[0]), min(a[1], b[1])
    c0, c1 = max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


class _Reader:
    """Verified, memory-mapped access to a checkpoint's files."""

    def __init__(self, path: str, manifest: dict):
        self._path = path
        self._files = manifest["files"]
        self._arrays: dict[str, np.ndarray] = {}

    def verify(self, name: str) -> None:
        """Checks the file's sha256 (streamed) against the manifest."""
        meta = self._files.get(name)
        full = os.path.join(self._path, name)
        if meta is None:
            raise ValueError(f"checkpoint {self._path!r}: file {name!r} is not listed in "
                             "its manifest")
        digest = hashlib.sha256()
        try:
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"checkpoint file {full!r} is missing") from e
        if digest.hexdigest() != meta["sha256"]:
            raise ValueError(f"checkpoint file {full!r} is corrupt: sha256 "
                             f"{digest.hexdigest()} != {meta['sha256']} in the manifest")

    def array(self, name: str) -> np.ndarray:
        """The file as a read-only memory map (only the slices read are loaded)."""
        if name not in self._arrays:
            meta = self._files[name]
            full = os.path.join(self._path, name)
            mode = "r" if math.prod(meta["shape"]) > 0 else None  # mmap of 0 bytes fails
            array = np.load(full, mmap_mode=mode, allow_pickle=False)
            if list(array.shape) != list(meta["shape"]) or array.dtype.str != meta["dtype"]:
                raise ValueError(f"checkpoint file {full!r} holds {array.dtype.str} "
                                 f"{list(array.shape)}; the manifest says {meta['dtype']} "
                                 f"{meta['shape']}")
            self._arrays[name] = array
        return self._arrays[name]


def _assign_rect(reader: _Reader, var: tf.Variable, rect: tuple, sources: list[_Saved],
                 slot: str | None, rowwise: bool) -> None:
    """Fills ``var`` (the rectangle ``rect`` of a table, or a slot of it) chunk by chunk.

    ``var`` is ``[rows, cols]`` (a table or a full-shape slot: copied from the
    overlapping saved rectangles) or, with ``rowwise``, ``[rows]`` (a row-wise slot: each
    saved slice holds a mean over its columns, so the new value is their column-count
    weighted mean). The layouts were checked against the manifest by ``_check_source``.
    """
    r0, r1, c0, c1 = rect
    rows, width = r1 - r0, c1 - c0
    dtype = _numpy_dtype(var)
    for start, stop in _row_chunks(rows, (1 if rowwise else width) * dtype.itemsize):
        chunk = (r0 + start, r0 + stop, c0, c1)
        if rowwise:
            buffer = np.zeros([stop - start], np.float64)
        else:
            buffer = np.empty([stop - start, width], dtype)
        for source in sources:
            cut = _overlap(source.rect, chunk)
            if cut is None:
                continue
            data = reader.array(source.file if slot is None else source.slots[slot])
            sr0, sc0 = source.rect[0], source.rect[2]
            rows_in_source = slice(cut[0] - sr0, cut[1] - sr0)
            rows_in_chunk = slice(cut[0] - chunk[0], cut[1] - chunk[0])
            if rowwise:
                buffer[rows_in_chunk] += np.asarray(data[rows_in_source], np.float64) * (
                    cut[3] - cut[2])
            else:
                buffer[rows_in_chunk, cut[2] - c0:cut[3] - c0] = data[
                    rows_in_source, cut[2] - sc0:cut[3] - sc0]
        if rowwise:
            buffer = (buffer / width).astype(dtype)
        # scatter_update writes in place; a sliced assign may copy the whole variable
        var.scatter_update(tf.IndexedSlices(buffer, tf.range(start, stop)))


def _assign_dense(reader: _Reader, var: tf.Variable, name: str, what: str) -> None:
    data = reader.array(name)
    if tuple(data.shape) != tuple(var.shape) or data.dtype != _numpy_dtype(var):
        raise ValueError(f"variable {what!r} ({var.name}) is {var.dtype.name} "
                         f"{var.shape.as_list()}; checkpoint file {name!r} holds "
                         f"{data.dtype.name} {list(data.shape)}")
    if data.ndim == 0:
        var.assign(np.asarray(data))
        return
    width = math.prod(data.shape[1:])
    for start, stop in _row_chunks(data.shape[0], width * data.dtype.itemsize):
        var.scatter_update(tf.IndexedSlices(np.asarray(data[start:stop]),
                                            tf.range(start, stop)))


# ------------------------------------------------------------ agreement
def _exchange(mesh: mesh_lib.Mesh, name: str, record: dict) -> list[dict]:
    """Allgathers one JSON record per rank over the whole mesh; returns them by rank.

    Each record travels as one line of bytes (``json.dumps`` escapes newlines), so one
    variable-length allgather carries them all.
    """
    data = np.frombuffer((json.dumps(record) + "\n").encode(), np.uint8)
    gathered = collectives.allgather(tf.constant(data), mesh.size, name)
    lines = bytes(np.asarray(gathered)).decode().split("\n")[:-1]
    if len(lines) != mesh.size:
        raise RuntimeError(f"{name}: got {len(lines)} records from {mesh.size} ranks")
    return [json.loads(line) for line in lines]


def _failure(error: BaseException) -> dict:
    return {"ok": False, "type": type(error).__name__, "error": str(error)}


def _raise_failed(records: list[dict], local: BaseException | None, what: str) -> None:
    """Raises the same error on every rank when any rank failed."""
    failed = [(r, rec) for r, rec in enumerate(records) if not rec["ok"]]
    if not failed:
        return
    # ranks that failed alike (a corrupt file every rank reads) are listed once
    by_error: dict[str, list[int]] = {}
    for r, rec in failed:
        by_error.setdefault(f"{rec['type']}: {rec['error']}", []).append(r)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {error}"
             for error, ranks in by_error.items()]
    detail = "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more" if len(parts) > 4 else "")
    # the first failure's type on every rank, so all ranks raise alike
    cls = _ERROR_TYPES.get(failed[0][1]["type"], RuntimeError)
    raise cls(f"{what} failed on {len(failed)} rank(s): {detail}") from local


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"checkpoint.{what} reads and writes files; call it eagerly, "
                           "not inside a tf.function")
