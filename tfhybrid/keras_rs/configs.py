"""keras-rs's feature and table configurations, read by their public attributes.

keras-rs is not a run-time dependency of tfhybrid: ``keras_rs.layers.FeatureConfig`` /
``TableConfig`` objects are read by the attributes keras-rs 0.4.0 documents (``name``,
``table``, ``input_shape``, ``output_shape``; ``name``, ``vocabulary_size``,
``embedding_dim``, ``initializer``, ``optimizer``, ``combiner``, ``placement``, ...), and
:class:`TableConfig` / :class:`FeatureConfig` here are stand-ins with the same fields for
code (and saved models) without keras-rs. This module checks them (``ValueError`` naming
the value), lists the features of a nested structure in keras-rs's order, maps a nested
structure of inputs onto them and back, and writes and reads keras-rs's serialized form
(tables listed once, features naming theirs by index, so shared tables stay shared).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf

__all__ = ["TableConfig", "FeatureConfig", "Feature", "read_features", "flatten_like",
           "pack_like", "serialize_features", "deserialize_features",
           "SUPPORTED_COMBINERS", "SUPPORTED_PLACEMENTS"]

# keras-rs 0.4.0's own lists (embed_reduce.py, base_distributed_embedding.py)
SUPPORTED_COMBINERS = ("mean", "sum", "sqrtn")
SUPPORTED_PLACEMENTS = ("auto", "default_device", "sparsecore")
_TABLE_FIELDS = ("name", "vocabulary_size", "embedding_dim", "initializer", "optimizer",
                 "combiner", "placement")
_FEATURE_FIELDS = ("name", "table", "input_shape", "output_shape")


def _default_initializer() -> Any:
    # keras-rs's default: VarianceScaling(mode="fan_out") over the whole table
    return tf.keras.initializers.VarianceScaling(mode="fan_out")


@dataclasses.dataclass(eq=False)
class TableConfig:
    """A stand-in for ``keras_rs.layers.TableConfig`` (same fields and defaults), for
    code without keras-rs; keras-rs's own objects are taken as they are.

    Example::

        from tfhybrid.keras_rs import FeatureConfig, TableConfig
        table = TableConfig(name="item", vocabulary_size=100, embedding_dim=8,
                            combiner="sum")
        feature = FeatureConfig(name="item", table=table, input_shape=(32, 4),
                                output_shape=(32, 8))
        assert feature.table.combiner == "sum" and table.placement == "auto"
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Any = dataclasses.field(default_factory=_default_initializer)
    optimizer: Any = "adam"
    combiner: str = "mean"
    placement: str = "auto"
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256

    def get_config(self) -> dict:
        config = dataclasses.asdict(self)
        for key in ("initializer", "optimizer"):
            value = getattr(self, key)
            if not isinstance(value, str) and value is not None:
                config[key] = (tf.keras.initializers.serialize(value) if key == "initializer"
                               else tf.keras.optimizers.serialize(value))
        return config

    @classmethod
    def from_config(cls, config: dict) -> "TableConfig":
        config = dict(config)
        if isinstance(config.get("initializer"), dict):
            config["initializer"] = tf.keras.initializers.deserialize(config["initializer"])
        if isinstance(config.get("optimizer"), dict):
            config["optimizer"] = tf.keras.optimizers.deserialize(config["optimizer"])
        return cls(**config)


@dataclasses.dataclass(eq=False)
class FeatureConfig:
    """A stand-in for ``keras_rs.layers.FeatureConfig`` (same fields); features that
    name the same table object share it.

    Example::

        from tfhybrid.keras_rs import FeatureConfig, TableConfig
        words = TableConfig(name="words", vocabulary_size=1000, embedding_dim=8)
        title = FeatureConfig(name="title", table=words, input_shape=(64, None),
                              output_shape=(64, 8))
        body = FeatureConfig(name="body", table=words, input_shape=(64, None),
                             output_shape=(64, 8))
        assert title.table is body.table and title.table.combiner == "mean"
    """

    name: str
    table: Any
    input_shape: Sequence[int | None]
    output_shape: Sequence[int | None]

    def get_config(self) -> dict:
        return {"name": self.name, "table": self.table.get_config(),
                "input_shape": self.input_shape, "output_shape": self.output_shape}

    @classmethod
    def from_config(cls, config: dict) -> "FeatureConfig":
        return cls(**dict(config, table=TableConfig.from_config(config["table"])))


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature as the layer reads it: its path in the nested structure (keras-rs's
    ``"a.b"`` form), its config and the index of its table."""
    path: str
    config: Any
    table: int


# ---------------------------------------------------------------- structures
def _walk(structure: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) of a nested structure of dicts (sorted keys, as keras.tree and
    tf.nest order them), lists and tuples; anything else is a leaf."""
    if isinstance(structure, dict):
        return [item for key in sorted(structure) for item in _walk(structure[key],
                                                                    path + (key,))]
    if isinstance(structure, (list, tuple)):
        return [item for i, value in enumerate(structure)
                for item in _walk(value, path + (i,))]
    return [(path, structure)]


def _path_text(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def flatten_like(structure: Any, values: Any, what: str) -> list:
    """``values`` laid out as ``structure`` (the feature configs), as a list in the
    features' order; its leaves may themselves be nested (a shape tuple).
    ``ValueError`` names the first place where ``values`` does not follow
    ``structure``."""
    flat = []

    def visit(config: Any, value: Any, path: tuple) -> None:
        if isinstance(config, dict):
            if not isinstance(value, dict) or set(value) != set(config):
                raise ValueError(
                    f"{what} at {_path_text(path) or 'the top'!r} must be a dict with the "
                    f"keys {sorted(config)} of feature_configs; got {_describe(value)}")
            for key in sorted(config):
                visit(config[key], value[key], path + (key,))
        elif isinstance(config, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(config):
                raise ValueError(
                    f"{what} at {_path_text(path) or 'the top'!r} must be a list of "
                    f"{len(config)} entries, as in feature_configs; got {_describe(value)}")
            for i, (c, v) in enumerate(zip(config, value)):
                visit(c, v, path + (i,))
        else:
            flat.append(value)

    visit(structure, values, ())
    return flat


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value, key=str)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} entries"
    return f"{type(value).__name__}"


def pack_like(structure: Any, flat: Sequence[Any]) -> Any:
    """``flat`` (one entry per feature, in order) in ``structure``'s nesting (dicts in
    their own key order, lists, tuples), as keras-rs returns its outputs."""
    leaves = iter(flat)

    def build(config: Any) -> Any:
        if isinstance(config, dict):
            built = {key: build(config[key]) for key in sorted(config)}
            return {key: built[key] for key in config}
        if isinstance(config, (list, tuple)):
            items = [build(c) for c in config]
            return list(items) if isinstance(config, list) else tuple(items)
        return next(leaves)

    return build(structure)


# ---------------------------------------------------------------- checks
def _check_fields(value: Any, fields: Sequence[str], kind: str, where: str) -> None:
    missing = [f for f in fields if not hasattr(value, f)]
    if missing:
        raise ValueError(f"{where}: expected a keras_rs.layers.{kind} (or "
                         f"tfhybrid.keras_rs.{kind}); got {value!r}, which has no "
                         f"{missing}")


def _check_table(table: Any, where: str) -> None:
    _check_fields(table, _TABLE_FIELDS, "TableConfig", where)
    if not isinstance(table.name, str) or not table.name:
        raise ValueError(f"{where}: TableConfig name={table.name!r} must be a non-empty "
                         "string")
    for field in ("vocabulary_size", "embedding_dim"):
        value = getattr(table, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"table {table.name!r}: {field}={value!r} must be an int >= 1")
    if table.combiner not in SUPPORTED_COMBINERS:
        # keras-rs's own message (EmbedReduce)
        raise ValueError(f"Invalid `combiner`: '{table.combiner}', use one of "
                         f"{', '.join(SUPPORTED_COMBINERS)}.")


def read_features(feature_configs: Any) -> tuple[list[Feature], list[Any]]:
    """The features of a nested structure of feature configs, in order, and their tables
    (each ``TableConfig`` object once, in the order features first name it: features
    that name the same object share its table, as in keras-rs). ``ValueError`` names
    the first config that is not one, a bad field or two tables of one name."""
    leaves = _walk(feature_configs)
    if not leaves or (len(leaves) == 1 and leaves[0][1] is None):
        raise ValueError(f"feature_configs={feature_configs!r} holds no FeatureConfig")
    features, tables, index_of = [], [], {}
    for path, config in leaves:
        text = _path_text(path)
        where = f"feature_configs[{text!r}]" if text else "feature_configs"
        _check_fields(config, _FEATURE_FIELDS, "FeatureConfig", where)
        table = config.table
        if id(table) not in index_of:
            _check_table(table, f"{where} (feature {config.name!r})")
            if table.placement not in SUPPORTED_PLACEMENTS:
                # keras-rs's own message
                raise ValueError(f"Feature '{text}' with name '{config.name}' has "
                                 f"unsupported placement '{table.placement}'.")
            clash = [t for t in tables if t.name == table.name]
            if clash:
                raise ValueError(
                    f"two TableConfig objects are named {table.name!r} (features "
                    f"{[f.config.name for f in features if tables[f.table] is clash[0]]} "
                    f"and {config.name!r}); features share a table by naming the same "
                    "TableConfig object, and distinct tables need distinct names")
            index_of[id(table)] = len(tables)
            tables.append(table)
        shape = config.input_shape
        if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= 2:
            raise ValueError(f"feature {config.name!r}: input_shape={shape!r} must be "
                             "(batch,) or (batch, ids per sample): inputs of rank 3 and "
                             "higher are not allowed, as in keras-rs")
        features.append(Feature(text, config, index_of[id(table)]))
    return features, tables


# ---------------------------------------------------------------- serialization
def serialize_features(feature_configs: Any, features: Sequence[Feature],
                       tables: Sequence[Any]) -> tuple[Any, list[dict]]:
    """keras-rs's form: the features' configs in their nesting with ``"table"`` the
    index of their table, and the tables' configs, each once."""
    def one(feature: Feature) -> dict:
        config = feature.config.get_config()
        config["table"] = feature.table
        return config
    nested = pack_like(feature_configs, [one(f) for f in features])
    return nested, [t.get_config() for t in tables]


def deserialize_features(nested: Any, table_configs: Sequence[dict],
                         feature_class: Any, table_class: Any) -> Any:
    """The inverse of :func:`serialize_features`, with the classes given (keras-rs's
    when it is installed, else the stand-ins): one table object per serialized table,
    shared by the features that name it."""
    tables = [table_class.from_config(dict(c)) for c in table_configs]

    def build(node: Any) -> Any:
        # a serialized feature is a dict with a string "name" (keras-rs's own test)
        if isinstance(node, dict) and isinstance(node.get("name"), str) and "table" in node:
            fields = {k: node[k] for k in _FEATURE_FIELDS if k != "table"}
            return feature_class(table=tables[int(node["table"])], **fields)
        if isinstance(node, dict):
            return {key: build(value) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(build(value) for value in node)
        raise ValueError(f"feature_configs holds {node!r}, which is not a serialized "
                         "FeatureConfig")

    return build(nested)
