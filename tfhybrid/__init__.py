"""tfhybrid: hybrid (2D) model/data-parallel embeddings for TensorFlow 2 + Horovod.

The public surface is small on purpose, like Horovod's:

- ``tfhybrid.init(model_parallel=M, layout=...)`` builds the D x M process mesh;
- ``tfhybrid.layers.DistributedEmbedding`` shards embedding tables over it;
- ``tfhybrid.DistributedGradientTape`` / ``tfhybrid.DistributedOptimizer`` route gradients;
- ``tfhybrid.broadcast_variables`` (and the ``BroadcastGlobalVariablesCallback``) makes
  every rank start from the same weights;
- ``tfhybrid.optimizers`` holds the row-wise AdaGrad optimizers;
- ``tfhybrid.TrainPipeline`` sends the next batch's ids while a step computes.
- ``tfhybrid.compression.DCT`` turns on DCT's thresholded communication (both halves).
- ``tfhybrid.serving`` exports a stock SavedModel with tables in a Redis Cluster and
  serves it (``export``, ``Predictor``, ``PublishDeltas``, ``RedisStore``).
- ``tfhybrid.keras_rs.DistributedEmbedding`` is keras-rs's layer with its tables on the mesh.

Attributes load lazily, so ``import tfhybrid.plan`` pulls in neither TensorFlow nor
Horovod.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from typing import Any

__version__ = "0.1.0"


def installed_keras_major() -> int | None:
    """The major version of the installed ``keras`` package (None without one): 3 on
    TF >= 2.16 stacks, where tf.keras may be Keras 3; 2 on TF <= 2.15, whose tf.keras is
    always Keras 2. Which Keras tf.keras *is* in this process may differ:
    :func:`keras_major`.

    >>> installed_keras_major() in (None, 2, 3)
    True
    """
    try:
        return int(metadata.version("keras").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def keras_major() -> int:
    """The major version of the Keras that ``tf.keras`` is in this process: 2 (tf-keras,
    or TF <= 2.15's own) or 3. Asking settles TensorFlow's choice, which it makes at the
    first use of ``tf.keras`` (``TF_USE_LEGACY_KERAS``); code written for both Kerases
    branches on it, e.g. for the weights file's name, which Keras 3 requires to end in
    ``.weights.h5``.

    >>> keras_major() in (2, 3)
    True
    """
    from tfhybrid import _tf_internals
    return _tf_internals.KERAS_MAJOR


# tfhybrid runs with Keras 2 (tf-keras) or Keras 3 as tf.keras, whichever TensorFlow
# gives: from TF 2.16 on, Keras 3 unless the user sets TF_USE_LEGACY_KERAS=1 before
# tf.keras is first used. Importing tfhybrid leaves that choice alone.

# public name -> module that defines it
_LAZY_ATTRIBUTES = {
    "init": "tfhybrid.mesh",
    "Mesh": "tfhybrid.mesh",
    "current_mesh": "tfhybrid.mesh",
    "DistributedGradientTape": "tfhybrid.distributed",
    "DistributedOptimizer": "tfhybrid.distributed",
    "broadcast_variables": "tfhybrid.distributed",
    "sync_replicas": "tfhybrid.distributed",
    "DistributedEmbedding": "tfhybrid.layers.distributed_embedding",
    "TrainPipeline": "tfhybrid.pipeline",
    "BroadcastGlobalVariablesCallback": "tfhybrid.callbacks",
    # NVIDIA distributed-embeddings' private helper, for scripts that import it
    "_dp_to_mp_input": "tfhybrid.layers.distributed_embedding",
}
_LAZY_SUBMODULES = {"layers", "optimizers", "planner", "custom_ops", "callbacks", "train",
                    "compression", "keras_rs", "serving"}

__all__ = (sorted(n for n in _LAZY_ATTRIBUTES if not n.startswith("_")) + sorted(_LAZY_SUBMODULES)
           + ["installed_keras_major", "keras_major"])


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tfhybrid.{name}")
    raise AttributeError(f"module 'tfhybrid' has no attribute {name!r}")
