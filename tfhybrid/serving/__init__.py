"""Serving what tfhybrid trained: a stock SavedModel plus tables in a Redis Cluster.

- ``RedisStore``: the cluster (``tfhybrid.serving.store``);
- ``export``: called on every rank, writes the SavedModel (rank 0) and the external
  tables (the ranks that hold them) (``tfhybrid.serving.exporter``);
- ``Predictor``: raw inputs in, scores out, rows fetched from the store
  (``tfhybrid.serving.predictor``); it needs neither Horovod nor tfhybrid's op library;
- ``PublishDeltas``: a Keras callback that publishes changed rows and a new SavedModel
  version every K steps (``tfhybrid.serving.deltas``).

Names load lazily, so ``from tfhybrid.serving import Predictor`` imports no layer.
See docs/serving.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_ATTRIBUTES = {
    "RedisStore": "tfhybrid.serving.store",
    "StoreUnavailable": "tfhybrid.serving.store",
    "export": "tfhybrid.serving.exporter",
    "Predictor": "tfhybrid.serving.predictor",
    "PublishDeltas": "tfhybrid.serving.deltas",
}

__all__ = sorted(_LAZY_ATTRIBUTES)


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfhybrid.serving' has no attribute {name!r}")
