"""The training app's checkpoints: numbered ``tf.train.Checkpoint``s that restore onto any mesh.

A checkpoint is ``<directory>/ckpt-<step>`` (TensorFlow's ``.index`` and ``.data-*``
files) of ``tf.train.Checkpoint(model=..., optimizer=...)``, kept by a
``tf.train.CheckpointManager``, whose ``<directory>/checkpoint`` file names the latest.
Everything that makes it work across meshes lives in the library, behind TensorFlow's
own mechanism, so Keras' ``save_weights``, ``ModelCheckpoint`` and ``BackupAndRestore``
write the same format:

- each ``DistributedEmbedding`` table, and each optimizer slot of a table, is one tensor
  of the table's full shape under a mesh-independent name, written in pieces and read
  back in the pieces of the current plan (``tfhybrid/checkpoint/tables.py``, ``slots.py``);
- every rank takes part in a save and each piece is written once; nothing is recorded as
  the latest checkpoint before all of it is on disk (``tfhybrid/checkpoint/writer.py``).

So a checkpoint written on one mesh restores onto any other (2x2 -> 1x4, 4x1, one
process), tables may change placement, and a crash during a save leaves the previous
checkpoint the latest. The optimizer must be a ``tfhybrid.DistributedOptimizer`` for its
table slots to follow the tables onto another mesh.

Public API::

    save(directory, model, optimizer, step, mesh=None, keep=3) -> str
    restore(directory_or_path, model, optimizer, mesh=None) -> int
    latest(directory) -> str | None
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid import slot_owners
from tfhybrid.checkpoint import writer
from tfhybrid.layers.distributed_embedding import DistributedEmbedding

__all__ = ["save", "restore", "latest", "CHECKPOINT_NAME"]

# checkpoints are <directory>/ckpt-<step>
CHECKPOINT_NAME = "ckpt"
_STEP = re.compile(rf"{CHECKPOINT_NAME}-(\d+)$")


def save(directory: str, model: tf.keras.Model,
         optimizer: tf.keras.optimizers.Optimizer | None, step: int,
         mesh: mesh_lib.Mesh | None = None, keep: int = 3) -> str:
    """Writes ``model`` (and ``optimizer``) as ``<directory>/ckpt-<step>``; returns its prefix.

    Every rank must call it at the same step with the same ``directory``. It returns on
    every rank once the checkpoint is complete and recorded as the latest; if any rank
    fails to write, every rank raises and the previous checkpoint stays the latest. The
    ``keep`` newest saves are kept. An optimizer that has not stepped yet gets its slots
    first, so that it saves what it would start from (or what it restored). ``mesh`` is
    the one the model was built on (default: the current one).

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
    _check_model(model, mesh or mesh_lib.current_mesh())
    _build_optimizer(model, optimizer)
    manager = tf.train.CheckpointManager(_checkpoint(model, optimizer), directory,
                                         max_to_keep=keep, checkpoint_name=CHECKPOINT_NAME)
    return manager.save(checkpoint_number=step)


def restore(directory_or_path: str, model: tf.keras.Model,
            optimizer: tf.keras.optimizers.Optimizer | None,
            mesh: mesh_lib.Mesh | None = None) -> int:
    """Loads a checkpoint into ``model`` (and ``optimizer``); returns its step.

    ``directory_or_path`` is a checkpoint prefix (``.../ckpt-<step>``) or a directory
    (its latest checkpoint). The mesh and the sharding plans may differ from the ones it
    was saved with. The optimizer's slots are made first if it has none yet; a
    checkpoint saved without an optimizer leaves the optimizer as it is. Every rank
    must call it; if any rank fails, every rank raises: ``FileNotFoundError`` when there
    is no checkpoint, ``ValueError`` when the model's variables do not match it,
    ``RuntimeError`` naming TensorFlow's error otherwise (a table of another shape, a
    corrupt file).

    Example: see :func:`save`.
    """
    mesh = mesh or mesh_lib.current_mesh()
    local_error, step = None, -1
    try:
        step = _restore(os.fspath(directory_or_path), model, optimizer, mesh)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = e
    # a rank that failed alone would leave the others waiting in their first step
    writer.agree(mesh, "tfhybrid_checkpoint_restore", local_error,
                 f"restoring checkpoint {directory_or_path!r}")
    return step


def _restore(path: str, model: Any, optimizer: Any, mesh: mesh_lib.Mesh) -> int:
    _check_model(model, mesh)
    if tf.io.gfile.isdir(path):
        found = latest(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path!r}")
        path = found
    elif not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    match = _STEP.search(path)
    if match is None:
        raise ValueError(f"checkpoint {path!r} is not named {CHECKPOINT_NAME}-<step>")
    if optimizer is not None and not any(key.startswith("optimizer/")
                                         for key, _ in tf.train.list_variables(path)):
        optimizer = None   # saved without one: the optimizer stays as it is
    _build_optimizer(model, optimizer)
    status = _checkpoint(model, optimizer).read(path)
    try:
        # every variable that exists now got a value
        status.assert_existing_objects_matched()
    except AssertionError as e:
        raise ValueError(f"checkpoint {path!r} does not match the model: {e}") from None
    return int(match.group(1))


def latest(directory: str) -> str | None:
    """The latest complete checkpoint in ``directory`` (its prefix), or None.

    Example::

        import tempfile
        from tfhybrid.train import checkpoint
        assert checkpoint.latest(tempfile.mkdtemp()) is None
    """
    return tf.train.latest_checkpoint(directory)


def _checkpoint(model: Any, optimizer: Any) -> tf.train.Checkpoint:
    return (tf.train.Checkpoint(model=model) if optimizer is None
            else tf.train.Checkpoint(model=model, optimizer=optimizer))


def _build_optimizer(model: Any, optimizer: Any) -> None:
    """Makes the optimizer's slots now, as its first step would: the embedding optimizer's
    for the tables, the optimizer's for the rest. A restore then fills them at once, and
    a save before the first step still holds them (Keras makes them in that step)."""
    if optimizer is None:
        return
    variables = model.trainable_variables
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    groups = [(optimizer, variables)]
    if embedding_optimizer is not None:
        groups = [(optimizer, [v for v in variables if not roles.is_embedding(v)]),
                  (embedding_optimizer, [v for v in variables if roles.is_embedding(v)])]
    for owner, owned in groups:
        owner = slot_owners.base_optimizer(owner)   # a loss scale's inner optimizer
        _tf_internals.build_optimizer(owner, owned)


def _check_model(model: Any, mesh: mesh_lib.Mesh) -> None:
    """Every DistributedEmbedding of ``model`` is built, on ``mesh``."""
    layers = [layer for layer in _tf_internals.layers_in(model)
              if isinstance(layer, DistributedEmbedding)]
    for layer in layers:
        if layer.plan is None or not layer.built:
            raise ValueError(f"DistributedEmbedding {layer.name!r} is not built; call the "
                             "model on a batch (or build it) before saving or restoring")
        if layer.mesh.shape != mesh.shape or layer.mesh.layout != mesh.layout:
            raise ValueError(f"DistributedEmbedding {layer.name!r} was built on mesh "
                             f"{layer.mesh.shape} ({layer.mesh.layout}), not on the given "
                             f"mesh {mesh.shape} ({mesh.layout})")
