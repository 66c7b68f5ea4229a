"""The tables a DistributedEmbedding shards: each one's spec, checks and initial values.

A ``TableSpec`` is what the layer keeps of one Keras embedding layer (its shape,
combiner, initializer, and whether it is a custom layer, a FIITED table or a tiered
one); the checks say which plans a spec cannot follow; ``slice_initializer`` draws any
shard's slice of the whole table's initial value, the same on every mesh.

Example::

    import tensorflow as tf
    from tfhybrid.sharding.tables import table_from_layer
    spec = table_from_layer(tf.keras.layers.Embedding(10, 4, name="users"))
    assert (spec.name, spec.rows, spec.dim) == ("users", 10, 4)
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid.dynamic.keys import as_keys
from tfhybrid.plan.types import Shard
from tfhybrid.sharding.ownership import ownership_of


# Storage kinds, as a table's spec names them (``sharding/stores.py`` maps each to its
# store). A tier over FIITED chunks is a kind of its own, not a tier wrapping a FIITED
# store: the tier's cache holds each slot's chunk prefix, and its update reads the
# chunks each slot holds, so the FIITED pool's store cannot run behind a cache unchanged
# (one table class, ``ChunkedCachedTable``, does both).
KERNEL, FIITED, TIERED, TIERED_FIITED, CUSTOM, DYNAMIC = (
    "kernel", "fiited", "tiered", "tiered_fiited", "custom", "dynamic")


@dataclasses.dataclass(frozen=True)
class KeyedRules:
    """A dynamic table's rules (``tfhybrid.layers.DynamicEmbedding``'s options): its keys'
    dtype (``"int64"``, or ``"string"`` read as their fingerprints), sightings before
    admission, the eviction policy, the ttl in steps and the row a key without a slot
    reads."""
    key_dtype: str
    admit_after: int = 1
    evict: str | None = "lfu"
    ttl_steps: int | None = None
    # what a key without a slot reads (None: zeros)
    default_row: tuple | None = None


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One table as the layer shards it (from its Keras embedding layer); ``storage``
    names its storage kind (a key of ``sharding.stores.STORAGE_KINDS``)."""
    name: str
    rows: int
    dim: int
    combiner: str | None
    initializer: Any
    # a layer class with its own ``call`` (not Keras' or tfhybrid's Embedding): every
    # shard is an instance of it, made from its config with the shard's shape
    custom_class: Any = None
    custom_config: Any = None
    # FIITED (``dims="adaptive"``): chunks per row of the whole table, and the share of
    # them kept; None for a dense table
    chunks: int | None = None
    target_memory: float | None = None
    # a table in the disk tier (``cache_rows``): each shard keeps the same share of its
    # rows in a DRAM cache, its store in ``store_dir``
    cache_rows: int | None = None
    store_dir: str | None = None
    cache_policy: str = "lru"
    storage: str = KERNEL
    # a dynamic table of open-world keys (``rows`` is its capacity over the model group,
    # ``initializer`` a ``KeyedInitializer``); None for a table of rows [0, rows)
    keyed: KeyedRules | None = None

    @property
    def chunk_dim(self) -> int:
        return self.dim // self.chunks


def table_from_layer(layer: Any, custom: bool = False) -> TableSpec:
    """The spec of a Keras embedding layer's table; ``custom``: the layer has its own
    ``call`` (every shard is then an instance of its class)."""
    config = layer.get_config() if isinstance(layer, tf.keras.layers.Layer) else {}
    if {"capacity", "key_dtype"} <= set(config or {}):
        # a DynamicEmbedding: its keys are owned by their hash (hash_wise)
        return TableSpec(
            name=layer.name, rows=int(config["capacity"]), dim=int(config["output_dim"]),
            combiner=config["combiner"], initializer=layer.keyed_initializer,
            storage=DYNAMIC, keyed=KeyedRules(config["key_dtype"], config["admit_after"],
                                              config["evict"], config["ttl_steps"],
                                              layer.default_row))
    if not {"input_dim", "output_dim"} <= set(config or {}):
        raise ValueError(
            "embeddings must hold tf.keras.layers.Embedding / tfhybrid.layers.Embedding "
            "layers, or Keras layers whose get_config() has input_dim and output_dim (a "
            f"custom embedding layer); got {layer!r}")
    initializer = getattr(layer, "embeddings_initializer", None)
    if initializer is not None:
        initializer = tf.keras.initializers.get(initializer)
        init_config = initializer.get_config()
        if "seed" in init_config and init_config["seed"] is None:
            # An unseeded initializer draws its seed from Python's random when first
            # called, and only the ranks that hold the table call it: the ranks' random
            # streams (hence replicated tables and later layers) would drift apart.
            # Drawn here, for every table on every rank, the streams stay alike, and the
            # table starts the same on every mesh.
            initializer = type(initializer).from_config(
                dict(init_config, seed=random.randint(1, 2**31 - 2)))
    adaptive = config.get("dims") == "adaptive"
    tiered = config.get("cache_rows") is not None
    storage = (TIERED_FIITED if adaptive else TIERED) if tiered else (
        FIITED if adaptive else CUSTOM if custom else KERNEL)
    return TableSpec(name=layer.name, rows=int(config["input_dim"]), storage=storage,
                  dim=int(config["output_dim"]),
                  combiner=getattr(layer, "combiner", None),
                  initializer=initializer,
                  custom_class=type(layer) if custom else None,
                  custom_config=config if custom else None,
                  **({"chunks": int(config["chunks"]),
                      "target_memory": float(config["target_memory"])}
                     if adaptive else {}),
                  **({"cache_rows": int(config["cache_rows"]),
                      "store_dir": config["store_dir"],
                      "cache_policy": config.get("cache_policy", "lru")}
                     if tiered else {}))


def takes_strings(table: TableSpec) -> bool:
    """Whether ``table`` is fed strings (a dynamic table with ``key_dtype=tf.string``)."""
    return table.keyed is not None and table.keyed.key_dtype == "string"


def ids_as_int64(table: TableSpec, feature: int, ids: tf.Tensor) -> tf.Tensor:
    """A feature's ``ids`` as int64: a string-keyed dynamic table's strings as their keys,
    integers as they are; ``ValueError`` names the feature and a dtype its table does
    not take."""
    return as_keys(ids, "string" if takes_strings(table) else "int64",
                   f"feature {feature} (table {table.name!r})")


def in_tier(table: TableSpec) -> str:
    """The storage kind of ``table`` once in the disk tier: a tier over FIITED chunks
    for an adaptive table, else a tier of dense rows."""
    return TIERED_FIITED if table.chunks else TIERED


def custom_shard_layer(table: TableSpec, rows: int, width: int, name: str) -> Any:
    return table.custom_class.from_config(
        dict(table.custom_config, input_dim=rows, output_dim=width, name=name))


def check_custom_table(table: TableSpec, placement: Any) -> None:
    """A custom table layer runs on its shards' ids, so it must look up each id alone."""
    if ownership_of(placement.kind).splits_rows:
        raise ValueError(
            f"embedding layer {table.name!r} is a custom layer ({table.custom_class.__name__})"
            f", which the plan would split row_wise; raise row_slice_threshold above its "
            f"{table.rows * table.dim} elements (a custom call cannot look up part of a row "
            "range)")
    # probed eagerly, on every rank alike, so a bad layer fails everywhere at once
    with tf.init_scope():
        probe = custom_shard_layer(table, 3, 2, f"{table.name}_probe")
        ids = tf.constant([[0, 1], [2, 0]], tf.int64)
        probe.build(tf.TensorShape([None]))
        _tf_internals.mark_built(probe)
        got = tf.TensorShape(probe(ids).shape)
    if got != tf.TensorShape([2, 2, 2]) or len(probe.weights) != 1:
        raise ValueError(
            f"custom embedding layer {table.name!r} ({table.custom_class.__name__}) must map "
            "ids of shape S to outputs of shape S + [output_dim] with one [input_dim, "
            f"output_dim] weight; on ids [2, 2] with output_dim=2 it gave {got} and has "
            f"{len(probe.weights)} weights")


def check_table_config(layer: Any, table: TableSpec, placement: Any) -> None:
    """Raises ``ValueError`` for a Keras Embedding setting the plan cannot honour."""
    if table.chunks:
        for shard in placement.shards:
            if shard.col_start % table.chunk_dim or shard.col_end % table.chunk_dim:
                raise ValueError(
                    f"embedding layer {table.name!r} (dims='adaptive', chunks={table.chunks}"
                    f" of {table.chunk_dim} columns) is split into columns "
                    f"[{shard.col_start}, {shard.col_end}), which cut a chunk; choose "
                    "chunks so that each column slice holds whole chunks, or raise "
                    "column_slice_threshold above the table's size")
    variable_dtype = tf.as_dtype(layer.dtype_policy.variable_dtype)
    if variable_dtype != tf.float32:
        raise ValueError(
            f"embedding layer {table.name!r} has dtype={variable_dtype.name!r}; tables are "
            "stored in float32 (use a mixed precision policy such as 'mixed_float16' for "
            "16-bit compute and communication)")
    constraint = getattr(layer, "embeddings_constraint", None)
    if constraint is None or len(placement.shards) == 1:
        return
    axis = constraint.get_config().get("axis") if hasattr(constraint, "get_config") else None
    axes = set(axis if isinstance(axis, (list, tuple)) else [axis]) if axis is not None else set()
    # a norm over an axis the plan splits would see only part of its vector
    split = {0} if ownership_of(placement.kind).splits_rows else {1, -1}
    if axes & split or (axis is None and not isinstance(
            constraint, tf.keras.constraints.NonNeg)):
        raise ValueError(
            f"embedding layer {table.name!r} has embeddings_constraint={constraint!r}, "
            f"which needs whole {'columns' if 0 in split else 'rows'}, but the plan splits "
            f"the table {placement.kind} into {len(placement.shards)} shards; raise "
            "row_slice_threshold / column_slice_threshold above its size, or use an "
            "element-wise constraint")


# Seeded tables are drawn in blocks of this many rows, each from its own seed, so any
# shard's slice can be drawn alone and equals the same slice of the whole table.
_INIT_BLOCK_ROWS = 4096
_SHAPE_FREE_INITIALIZERS = (tf.keras.initializers.RandomUniform,
                            tf.keras.initializers.RandomNormal,
                            tf.keras.initializers.TruncatedNormal)


def slice_initializer(table: TableSpec, shard: Shard) -> Any:
    """The shard's slice of the table's initial value, the same on every mesh.

    Only for seeded initializers whose values do not depend on the shape (uniform and
    normal ones); any other initializer is applied to the shard itself, which gives
    different (equally distributed) values on different meshes.
    """
    config = table.initializer.get_config()
    if (not isinstance(table.initializer, _SHAPE_FREE_INITIALIZERS)
            or config.get("seed") is None):
        return table.initializer

    def initial_value(shape, dtype=tf.float32, **kwargs):
        blocks = []
        first = shard.row_start // _INIT_BLOCK_ROWS
        for block in range(first, -(-shard.row_end // _INIT_BLOCK_ROWS)):
            start = block * _INIT_BLOCK_ROWS
            rows = min(_INIT_BLOCK_ROWS, table.rows - start)
            seeded = type(table.initializer).from_config(
                dict(config, seed=(int(config["seed"]) * 1_000_003 + block) % (2**31 - 1)))
            values = seeded([rows, table.dim], dtype=dtype)
            blocks.append(values[max(shard.row_start, start) - start:
                                 min(shard.row_end, start + rows) - start,
                                 shard.col_start:shard.col_end])
        return tf.concat(blocks, axis=0) if len(blocks) > 1 else blocks[0]

    return initial_value
