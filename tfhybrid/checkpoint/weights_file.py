"""Keras 3's weights file (``model.save_weights("x.weights.h5")``) with sharded tables.

Keras 3 writes a ``.weights.h5`` by asking every layer and optimizer for its state
(``save_own_variables``) and reads it back the same way (``load_own_variables``). With
tables sharded over ranks, what a file must hold is the mesh-independent state the
TensorFlow checkpoints hold (``tables``, ``slots``):

- a ``DistributedEmbedding`` writes each table whole, once, under ``table_<t>``, gathered
  from its shards (a FIITED table also its chunk counts and utilities, under
  ``table_<t>_chunk_counts`` and ``table_<t>_utility`` as in a checkpoint); it reads the
  file's whole tables onto its current plan;
- an optimizer writes its variables other than table slots, numbered as in a list
  (``<member>_<i>``: the optimizer, then the optimizers inside it), and each table slot
  as one full tensor, ``layer_<k>_table_<t>_<slot>`` (a row-wise slot broadcast over
  its table's columns, read back as the mean over the new shard's columns);
- every rank takes part in a save (the gathers are collectives), rank 0 alone writes
  the file: into a temporary name, moved into place once every rank is done
  (``_tf_internals.install_weights_file_hook``), so no rank returns before the file is
  whole and a failed save leaves the previous file.

Keras 2 (tf-keras) writes ``save_weights`` as a TensorFlow checkpoint instead, which
``tables`` and ``slots`` answer; this module is Keras 3's only.
"""

from __future__ import annotations

import contextvars
import glob
import os
import weakref
from typing import Any, Callable

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.checkpoint import pieces
from tfhybrid.checkpoint import slots
from tfhybrid.checkpoint import tables
from tfhybrid.checkpoint import writer
from tfhybrid.plan.types import Kind
from tfhybrid.sharding.stores import saved_layout_of


def install() -> None:
    """Makes Keras 3 weights files of models with sharded tables be written by rank 0
    alone, after every rank gave its part, and the callbacks that every rank runs create
    their folders without racing each other (idempotent; nothing to do in Keras 2)."""
    if _tf_internals.KERAS_3:
        _tf_internals.install_weights_file_hook(_save_weights_file)
        _tf_internals.install_backup_cleanup_hook(_clean_up_backup)
        _tf_internals.install_shared_folder_hook()


def attach_optimizer(optimizer: Any) -> None:
    """Makes ``optimizer`` write and read its Keras 3 weights-file state as above (its
    checkpoint state is ``slots.attach_optimizer``'s). Nothing to do in Keras 2."""
    if _tf_internals.KERAS_3:
        install()
        _tf_internals.replace_own_variables(
            optimizer, lambda store: save_optimizer(optimizer, store),
            lambda store: load_optimizer(optimizer, store))
        # the optimizers inside it (an embedding optimizer is its attribute, which Keras
        # visits too) hold no state of their own in the file: the outer one writes it
        for inner in slots.state_of(optimizer).members()[1:]:
            _tf_internals.replace_own_variables(inner, _holds_nothing, _holds_nothing)


def _holds_nothing(store: Any) -> None:
    del store


def _save_weights_file(model: Any, filepath: Any, original: Any, *args: Any,
                       **kwargs: Any) -> Any:
    # a model saved without a mesh (none made, or reset since the hook was installed)
    # holds no sharded table
    mesh = mesh_lib.initialized_mesh()
    if mesh is None or mesh.size == 1 or not any(_holds(model, layer)
                                                 for layer in tables.built_layers()):
        return original(model, filepath, *args, **kwargs)
    final = os.fspath(filepath)
    # the gathers below are collectives: no rank enters them alone
    writer.join(mesh, "tfhybrid_weights_file_join", os.path.abspath(final))
    folder, name = os.path.split(os.path.abspath(final))
    # every rank runs Keras' save (its gathers are collectives); rank 0's file is kept
    staging = os.path.join(folder, f".tfhybrid-rank{mesh.rank}-{os.getpid()}-{name}")
    error = None
    save = writer.start_save()
    token = _SAVING_TOGETHER.set(True)
    try:
        original(model, staging, *args, **kwargs)
        writer.part_written(save)
    except BaseException as e:  # noqa: BLE001 - shared with every rank, then raised
        error = e
    finally:
        _SAVING_TOGETHER.reset(token)
    try:
        writer.agree(mesh, "tfhybrid_weights_file_written", error,
                     f"saving weights file {final!r}")
        if mesh.rank == 0:
            os.replace(staging, final)
    finally:
        if mesh.rank != 0 or error is not None:
            _remove(staging)
    # no rank returns before the file is in place
    writer.agree(mesh, "tfhybrid_weights_file_moved", None, f"saving weights file {final!r}")
    if mesh.rank == 0:
        # every rank has removed its own temporary file by now: any left are of a job
        # killed while saving here
        for stale in glob.glob(os.path.join(glob.escape(folder), f".tfhybrid-rank*-{name}")):
            _remove(stale)
    return None


def _clean_up_backup(callback: Any, own: Callable[[], None]) -> None:
    """Keras 3's ``BackupAndRestore.on_train_end`` (``own``, which deletes the backup)
    on rank 0 alone, once every rank has finished training, when the backup holds
    sharded tables; elsewhere Keras' own."""
    mesh = mesh_lib.initialized_mesh()
    model = getattr(callback, "model", None)
    if (mesh is None or mesh.size == 1 or model is None
            or not any(_holds(model, layer) for layer in tables.built_layers())):
        own()
        return
    writer.agree(mesh, "tfhybrid_backup_done", None, "ending training with a backup")
    error = None
    if mesh.rank == 0:
        try:
            own()
        except Exception as e:  # noqa: BLE001 - shared with every rank, then raised
            error = e
    writer.agree(mesh, "tfhybrid_backup_removed", error, "deleting the backup")


# True while every rank writes one weights file together (in _save_weights_file)
_SAVING_TOGETHER: "contextvars.ContextVar[bool]" = contextvars.ContextVar(
    "tfhybrid_saving_weights_together", default=False)


def saving_together() -> bool:
    """Whether every rank is writing one Keras 3 weights file together right now (a
    ``.keras`` file is not: each rank that saves writes its own)."""
    return _SAVING_TOGETHER.get()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _holds(model: Any, layer: Any) -> bool:
    return any(inner is layer for inner in _tf_internals.layers_in(model))


# ------------------------------------------------------------------ whole tensors
def _contributes(layer: Any, table: int) -> bool:
    """Whether this rank adds its pieces of ``table`` to a whole tensor: each piece once,
    from the first replica (a replicated table from rank 0 alone)."""
    mesh = layer.mesh
    first_replica = mesh.rank in mesh.model_groups[0]
    if layer.plan.tables[table].kind == Kind.DATA_PARALLEL:
        return mesh.rank == mesh.model_groups[0][0]
    return first_replica


def _whole(layer: Any, table: int, full_shape: tuple, held: list, name: str) -> np.ndarray:
    """The full tensor of ``held`` pieces of every rank, on every rank (a collective)."""
    dtype = held[0].dtype.as_numpy_dtype if held else np.float32
    dtype = np.float64 if dtype == np.float64 else np.float32
    full = np.zeros(full_shape, dtype)
    if _contributes(layer, table):
        for piece in held:
            rect = piece.rect
            full[rect.row_start:rect.row_end, rect.col_start:rect.col_end] = \
                tf.convert_to_tensor(piece.read()).numpy()
    return _all_sum(full, name)


def _assign(held: list, full: np.ndarray) -> None:
    for piece in held:
        rect = piece.rect
        piece.assign(tf.constant(full[rect.row_start:rect.row_end,
                                      rect.col_start:rect.col_end]))


# ------------------------------------------------------------------ the layer
def _laid_out_tables(layer: Any) -> list[tuple[int, Any, list]]:
    """(index, saved layout, held (rect, variable) pairs) of the layer's tables whose
    storage kind has a saved layout of its own (``stores.saved_layout_of``)."""
    found = []
    for t, (spec, held) in enumerate(zip(layer.table_specs, pieces.layer_pieces(layer))):
        layout = saved_layout_of(spec)
        if layout is not None:
            found.append((t, layout, held))
    return found


def _layer_keys(layer: Any) -> list[str]:
    return sorted([f"table_{t}" for t in range(len(layer.table_specs))]
                  + [key for t, layout, _ in _laid_out_tables(layer)
                     for key in layout.weights_file_keys(t)])


def _all_sum(array: np.ndarray, name: str) -> np.ndarray:
    return collectives.allreduce(tf.constant(array), hvd.Sum, name).numpy()


def save_layer(layer: Any, store: Any) -> None:
    """``DistributedEmbedding.save_own_variables``: each table whole, and what a table's
    own saved layout adds (a FIITED table's chunk counts and utilities), so that a load
    restores it on any mesh."""
    for t, table in enumerate(layer.get_weights(all_ranks=False)):
        store[f"table_{t}"] = table
    for t, layout, held in _laid_out_tables(layer):
        layout.save_to_weights_file(layer, t, held, store, _contributes(layer, t), _all_sum)


def load_layer(layer: Any, store: Any) -> None:
    """``DistributedEmbedding.load_own_variables``: the file's whole tables onto this
    rank's plan (a table's own layout first, then the values, then its other state)."""
    names, expected = sorted(store.keys()), _layer_keys(layer)
    if names != expected:
        raise ValueError(f"the weights file holds {names} for DistributedEmbedding "
                         f"{layer.name!r}, which has {len(layer.table_specs)} tables "
                         f"({expected})")
    laid_out = _laid_out_tables(layer)
    for t, layout, held in laid_out:
        layout.load_layout_from_weights_file(layer, t, held, store)
    # the values land in the rows' chunks: a pruned entry is dropped (it was saved as 0);
    # a kind whose layout saves its rows' state too loads the rows with it (by key)
    by_layout = {t for t, layout, _ in laid_out if layout.saves_row_state}
    layer.set_weights([None if t in by_layout else np.asarray(store[f"table_{t}"])
                       for t in range(len(layer.table_specs))])
    for t, layout, held in laid_out:
        layout.load_state_from_weights_file(layer, t, held, store)


# ------------------------------------------------------------------ the optimizer
def _slot_tensors(optimizer: Any) -> list[tuple[str, Any, int, tuple, list]]:
    """(key, layer, table, full shape, held pieces) of every table slot, in an order
    that is the same on every rank."""
    state = slots.state_of(optimizer)
    found = []
    for k, layer in enumerate(state.layers()):
        for key, (table, full_shape, held) in sorted(
                slots.layer_slot_pieces(optimizer, layer).items()):
            found.append((f"layer_{k}_{key}", layer, table, full_shape, held))
    return found


def _plain_variables(optimizer: Any) -> list[tuple[str, Any]]:
    """(key, variable) of the optimizers' variables other than table slots."""
    state = slots.state_of(optimizer)
    table_slots = state.table_slot_ids()
    return [(f"{m}_{i}", variable) for m, member in enumerate(state.members())
            for i, variable in enumerate(
                v for v in slots.variables_of(member) if id(v) not in table_slots)]


def save_optimizer(optimizer: Any, store: Any) -> None:
    """An optimizer's ``save_own_variables`` (see the module docstring)."""
    for key, variable in _plain_variables(optimizer):
        store[key] = np.asarray(variable)
    for key, layer, table, full_shape, held in _slot_tensors(optimizer):
        store[key] = _whole(layer, table, full_shape, held, f"tfhybrid_weights_file_{key}")


def load_optimizer(optimizer: Any, store: Any) -> None:
    """An optimizer's ``load_own_variables``. Keras 3 loads a weights file before an
    optimizer has taken a step, when it has no slots yet: the state then waits, and the
    build that makes the slots applies it (as TensorFlow defers a checkpoint's)."""
    saved = {key: np.asarray(store[key]) for key in store.keys()}
    if not _apply(optimizer, saved, raise_on_mismatch=False):
        # what exists before the build (the step counts) is read now, as from a
        # TensorFlow checkpoint; the build adds the slots after it, so the keys agree
        for key, variable in _plain_variables(optimizer):
            if key in saved and tuple(saved[key].shape) == tuple(variable.shape):
                variable.assign(saved[key])
        _WAITING[optimizer] = saved
        for member in slots.state_of(optimizer).members():
            _tf_internals.install_build_hook(member, lambda: _apply_waiting(optimizer))


# optimizer -> the weights-file state waiting for its build
_WAITING: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _apply_waiting(optimizer: Any) -> None:
    saved = _WAITING.get(optimizer)
    if saved is None or _apply(optimizer, saved, raise_on_mismatch=False):
        _WAITING.pop(optimizer, None)
        return
    if all(getattr(member, "built", False) for member in slots.state_of(optimizer).members()):
        # every member has its slots now, and the file's state still does not fit: say
        # so, rather than train on without it
        del _WAITING[optimizer]
        _apply(optimizer, saved)


def _apply(optimizer: Any, saved: dict, raise_on_mismatch: bool = True) -> bool:
    """Assigns ``saved`` when it fits the optimizer's state; else False (or raises,
    naming what differs)."""
    plain = _plain_variables(optimizer)
    slot_tensors = _slot_tensors(optimizer)
    expected = sorted([key for key, _ in plain] + [key for key, *_ in slot_tensors])
    if sorted(saved) != expected:
        if raise_on_mismatch:
            raise ValueError(f"the weights file holds the optimizer state {sorted(saved)}, "
                             f"but optimizer {getattr(optimizer, 'name', optimizer)!r} "
                             f"has {expected}")
        return False
    for key, variable in plain:
        variable.assign(saved[key])
    for key, layer, table, full_shape, held in slot_tensors:
        full = saved[key]
        if tuple(full.shape) != tuple(full_shape):
            raise ValueError(f"the weights file's {key!r} has shape {full.shape}; table "
                             f"{table} of layer {layer.name!r} needs {full_shape}")
        _assign(held, full)
    return True
