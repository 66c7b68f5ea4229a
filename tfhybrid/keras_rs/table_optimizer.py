"""keras-rs's per-table optimizers (``TableConfig.optimizer``) as the one Keras optimizer
``tfhybrid.DistributedOptimizer(..., embedding_optimizer=...)`` applies to every table.

keras-rs trains each table with its ``TableConfig.optimizer`` on TPUs (SGD, Adagrad, Adam
and FTRL); tfhybrid's gradient route gives the tables one optimizer of their own beside
the dense one. So the tables' optimizers are honoured exactly where they are one: every
table names the same class with the same configuration (keras-rs's default, ``"adam"``
on every table, is). Tables whose optimizers differ, or an optimizer outside those four,
raise ``ValueError`` naming them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import tensorflow as tf

__all__ = ["HONOURED", "PLANNED_AS", "table_optimizer_spec", "make_optimizer"]

# the optimizers keras-rs supports on TPUs, by their Keras class names
HONOURED = ("SGD", "Adagrad", "Adam", "Ftrl")
# the planner's name for each (``tfhybrid.plan.OPTIMIZERS``), whose state it counts:
# FTRL's two slots per element weigh what Adam's do
PLANNED_AS = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam", "Ftrl": "adam"}


def _spec(optimizer: Any, table: str) -> tuple[str, dict]:
    """(class name, config without the name) of one table's optimizer."""
    if optimizer is None:
        raise ValueError(f"table {table!r} has optimizer=None; table_optimizers='honour' "
                         f"needs one of {HONOURED} on every table")
    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = tf.keras.optimizers.get(optimizer)
        except ValueError as error:
            raise ValueError(f"table {table!r}: optimizer={optimizer!r} is not a Keras "
                             f"optimizer; table_optimizers='honour' applies one of "
                             f"{HONOURED}") from error
    name = type(optimizer).__name__
    if name not in HONOURED or not hasattr(tf.keras.optimizers, name):
        raise ValueError(f"table {table!r}: optimizer {name} is not one "
                         f"table_optimizers='honour' applies exactly; expected one of "
                         f"{HONOURED} (keras-rs's own list)")
    config = {k: v for k, v in optimizer.get_config().items() if k != "name"}
    try:
        make_optimizer((name, config))
    except TypeError as error:
        # a Keras 3 optimizer's config where tf.keras is Keras 2 (arguments it lacks)
        raise ValueError(f"table {table!r}: optimizer {name} with {config} cannot be made "
                         f"as this process's tf.keras.optimizers.{name}: {error}") from error
    return name, config


def table_optimizer_spec(tables: Sequence[Any]) -> tuple[str, dict]:
    """The one (class name, config) every table's ``optimizer`` names; ``ValueError``
    names an optimizer that is not honoured, or the tables whose optimizers differ."""
    found: dict[str, tuple[tuple[str, dict], list[str]]] = {}
    for table in tables:
        spec = _spec(table.optimizer, table.name)
        key = json.dumps(spec, sort_keys=True, default=repr)
        found.setdefault(key, (spec, []))[1].append(table.name)
    if len(found) > 1:
        groups = "; ".join(f"{spec[0]}({spec[1]}) on {names}"
                           for spec, names in found.values())
        raise ValueError(f"table_optimizers='honour' applies one optimizer to every table, "
                         f"but the tables name several: {groups}. Give them the same, or "
                         "use table_optimizers='model'")
    return next(iter(found.values()))[0]


def make_optimizer(spec: tuple[str, dict]) -> Any:
    """A new ``tf.keras`` optimizer of the spec."""
    name, config = spec
    return getattr(tf.keras.optimizers, name).from_config(dict(config))
