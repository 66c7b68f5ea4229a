"""keras-rs's per-table optimizers (``TableConfig.optimizer``) as the embedding optimizer
of ``tfhybrid.DistributedOptimizer(..., embedding_optimizer=...)``.

keras-rs trains each table with its ``TableConfig.optimizer`` on TPUs (SGD, Adagrad, Adam
and FTRL), and so does tfhybrid with ``table_optimizers="honour"``: where every table
names the same class with the same configuration (keras-rs's default, ``"adam"`` on every
table, does), the embedding optimizer is one new Keras optimizer of it; where they
differ, a ``tfhybrid.table_optimizers.TableOptimizers`` of one optimizer per distinct
configuration, by table name. An optimizer outside those four raises ``ValueError``
naming it.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import tensorflow as tf

from tfhybrid.plan.types import OPTIMIZER_STATE
from tfhybrid.table_optimizers import TableOptimizers

__all__ = ["HONOURED", "PLANNED_AS", "table_optimizer_specs", "planned_as",
           "make_table_optimizer", "make_optimizer"]

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


def table_optimizer_specs(tables: Sequence[Any]) -> dict[str, tuple[str, dict]]:
    """Table name -> (class name, config) of the optimizer each table names;
    ``ValueError`` names a table whose optimizer is not honoured."""
    return {table.name: _spec(table.optimizer, table.name) for table in tables}


def planned_as(specs: dict[str, tuple[str, dict]]) -> str:
    """The planner's name for the tables' optimizers: of several, the one with the most
    state per element, so the planner does not count too little."""
    return max((PLANNED_AS[name] for name, _ in specs.values()), key=OPTIMIZER_STATE.get)


def make_table_optimizer(specs: dict[str, tuple[str, dict]]) -> Any:
    """The embedding optimizer of tables naming ``specs``: one new Keras optimizer where
    every table names the same; else a ``TableOptimizers`` of one per distinct spec, by
    table name."""
    made: dict[str, Any] = {}
    for spec in specs.values():
        if _key(spec) not in made:
            made[_key(spec)] = make_optimizer(spec)
    if len(made) == 1:
        return next(iter(made.values()))
    return TableOptimizers({table: made[_key(spec)] for table, spec in specs.items()})


def _key(spec: tuple[str, dict]) -> str:
    return json.dumps(spec, sort_keys=True, default=repr)


def make_optimizer(spec: tuple[str, dict]) -> Any:
    """A new ``tf.keras`` optimizer of the spec."""
    name, config = spec
    return getattr(tf.keras.optimizers, name).from_config(dict(config))
