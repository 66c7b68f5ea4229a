"""What an export writes beside its SavedModel, and the names both ends agree on.

A version folder ``{directory}/{version}/`` is a stock SavedModel (what TensorFlow
Serving loads from a base folder of numbered versions) with three signatures:

- ``serving_default`` (``INLINE_SIGNATURE``): the model's own inputs, every table inline;
- ``feature_ids`` (``IDS_SIGNATURE``): the model's inputs to the ids each external
  feature looks up (int64, a dynamic table's keys), as the model hands them to its
  ``DistributedEmbedding``: one matrix of every feature's ids side by side
  (``IDS_OUTPUT``), and a ragged feature's ids, flat, under ``ragged_ids_output``;
- ``external_rows`` (``EXTERNAL_SIGNATURE``): the model's inputs, the distinct rows the
  request looks up (``ROWS_INPUT``) and each id's row among them (``POSITIONS_INPUT``,
  shaped as ``feature_ids``' matrix; a ragged feature's under
  ``ragged_positions_input``); it gathers and combines the bags itself.

A ragged input is two signature inputs, its values and row splits
(``tfhybrid.serving.inputs``).

``assets.extra/tfhybrid_serving.json`` (TensorFlow Serving ignores ``assets.extra``) is
the manifest: the version, the store's key prefix, the inputs, per layer its features
and tables (rows, width, column slices, combiner, external or inline, precision), each
external feature's columns in ``feature_ids``' matrix, and ``id_sources``: where the
export found every external feature's ids to be columns of an input (or a ragged
input's values), so a predictor reads them from the request without ``feature_ids``.
The store holds each external table's entry beside its rows.

>>> feature_key("embedding", 3)
'embedding__f3'
>>> version_folders(".")  # no numbered folders here
[]
"""

from __future__ import annotations

import json
import os
from typing import Any

INLINE_SIGNATURE = "serving_default"
EXTERNAL_SIGNATURE = "external_rows"
IDS_SIGNATURE = "feature_ids"
MANIFEST_PATH = os.path.join("assets.extra", "tfhybrid_serving.json")
# feature_ids' one output, and external_rows' two inputs beside the model's
IDS_OUTPUT = "ids"
ROWS_INPUT = "served_rows"
POSITIONS_INPUT = "served_positions"


def feature_key(layer: str, feature: int) -> str:
    """The signature key of feature ``feature`` of layer ``layer``."""
    return f"{layer}__f{feature}"


def ragged_ids_output(feature: str) -> str:
    """``feature_ids``' output of a ragged feature's ids (its values, flat)."""
    return f"{IDS_OUTPUT}.{feature}"


def ragged_positions_input(feature: str) -> str:
    """``external_rows``' input of a ragged feature's rows (a position per id, flat)."""
    return f"{POSITIONS_INPUT}.{feature}"


def table_key(layer: str, table: str) -> str:
    """The store's name of table ``table`` of layer ``layer``."""
    return f"{layer}.{table}"


def version_folders(directory: str) -> list[int]:
    """The numbered version folders of ``directory`` that hold a complete export."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(v) for v in os.listdir(directory) if v.isdigit() and os.path.exists(
        os.path.join(directory, v, MANIFEST_PATH)))


def write(version_dir: str, manifest: dict[str, Any]) -> None:
    """Writes the manifest last, atomically: a version folder with one is complete."""
    path = os.path.join(version_dir, MANIFEST_PATH)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def read(version_dir: str) -> dict[str, Any]:
    """The manifest of a version folder; ValueError naming a folder without one."""
    path = os.path.join(version_dir, MANIFEST_PATH)
    if not os.path.exists(path):
        raise ValueError(f"{version_dir!r} is not a tfhybrid serving export (no {path})")
    with open(path) as f:
        return json.load(f)
