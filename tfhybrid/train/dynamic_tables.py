"""The app's dynamic tables: which features get one, their options, and their figures.

``--dynamic_tables=all`` or a comma list of categorical features (0-based column indices
or the dataset's feature names, e.g. ``C1,C10`` or ``user_id``) makes those features'
tables ``tfhybrid.layers.DynamicEmbedding``: the data gives their columns as raw int64
keys (``tfhybrid.train.data``'s ``raw_keys``), and the tables admit and evict keys as
training goes. ``--dynamic_capacity`` (one value for all, or one per dynamic table in
feature order; default: the feature's fixed table rows), ``--dynamic_admit_after``,
``--dynamic_evict`` and ``--dynamic_ttl_steps`` set the layer's options. This module
reads them from a ``TrainConfig`` (duck-typed: it does not import the app) and checks
them, raising ``ValueError`` that names the flag and its value.

Example::

    >>> from types import SimpleNamespace
    >>> features("C1,3", "synthetic_open")
    (0, 3)
    >>> config = SimpleNamespace(dynamic_tables=("0", "2"), dataset="synthetic_open",
    ...     dynamic_capacity=(100,), dynamic_admit_after=None, dynamic_evict="lru",
    ...     dynamic_ttl_steps=None)
    >>> options = table_options(config, [10, 20, 30])
    >>> sorted(options), options[2]
    ([0, 2], {'capacity': 100, 'admit_after': 1, 'evict': 'lru', 'ttl_steps': None})
"""

from __future__ import annotations

from typing import Any, Sequence

from tfhybrid.train import data as data_lib

# --dynamic_evict's choices ("none": a full table refuses new keys)
EVICT_CHOICES = ("lfu", "lru", "none")
DEFAULT_EVICT = "lfu"
# the embedding optimizers that can train a dynamic table: row-wise state is the
# table's own (reset with a row's new key), plain SGD keeps none; any other keeps a slot
# per entry that would outlive the entry's key
OPTIMIZERS = ("rowwise_adagrad", "ms_rowwise_adagrad", "sgd")
# the counters of table_stats that add up over tables (totals)
SUMMED = ("size", "capacity", "admissions", "evictions", "refusals", "hits", "misses",
          "candidates")


def _listed(value: Any) -> list[str]:
    """A flag's list: absl's list, or a comma-separated string from a program."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    return [str(v).strip() for v in value if str(v).strip()]


def features(value: Any, dataset: str) -> tuple[int, ...]:
    """The categorical columns ``--dynamic_tables=value`` names for ``dataset``, sorted:
    ``all``, or indices and feature names. ValueError naming what is wrong."""
    listed = _listed(value)
    names = data_lib.feature_names(dataset)
    if not listed:
        return ()
    shown = ",".join(listed)
    if "all" in listed:
        if len(listed) > 1:
            raise ValueError(f"--dynamic_tables={shown}: 'all' stands alone")
        return tuple(range(len(names)))
    chosen = []
    for item in listed:
        if item.lstrip("-").isdigit():
            index = int(item)
            if not 0 <= index < len(names):
                raise ValueError(f"--dynamic_tables={shown}: feature index {index} is out "
                                 f"of range; {dataset} has {len(names)} categorical features "
                                 f"(0 to {len(names) - 1})")
        elif item in names:
            index = names.index(item)
        else:
            raise ValueError(f"--dynamic_tables={shown}: {item!r} is not a feature of "
                             f"{dataset}; expected 'all', indices 0 to {len(names) - 1} or "
                             f"names {', '.join(names[:3])}, ... {names[-1]}")
        if index in chosen:
            raise ValueError(f"--dynamic_tables={shown} names feature {names[index]} "
                             f"(index {index}) twice")
        chosen.append(index)
    return tuple(sorted(chosen))


def check(config: Any) -> None:
    """The dynamic flags of ``config``, as ValueErrors naming the flag and its value."""
    chosen = features(config.dynamic_tables, config.dataset)
    if config.open_key_lifetime is not None:
        _positive("open_key_lifetime", config.open_key_lifetime)
        if config.dataset != "synthetic_open":
            raise ValueError(f"--open_key_lifetime={config.open_key_lifetime} shapes "
                             f"--dataset=synthetic_open only; got --dataset={config.dataset}")
    given = [f"--{name}" for name in ("dynamic_capacity", "dynamic_admit_after",
                                      "dynamic_evict", "dynamic_ttl_steps",
                                      "dynamic_stats_every")
             if getattr(config, name) not in (None, (), [])]
    if not chosen:
        if given:
            raise ValueError(f"{', '.join(given)} set(s) dynamic tables' options, but "
                             "--dynamic_tables names none")
        return
    shown = ",".join(_listed(config.dynamic_tables))
    if config.dataset not in data_lib.RAW_KEY_DATASETS:
        raise ValueError(f"--dynamic_tables={shown} needs raw keys, which "
                         f"--dataset={config.dataset} does not give (it stores an empty field "
                         f"as the value 0); use one of {', '.join(data_lib.RAW_KEY_DATASETS)}")
    capacities = list(config.dynamic_capacity or ())
    for capacity in capacities:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"--dynamic_capacity={_joined(capacities)}: {capacity!r} is not "
                             "an integer >= 1")
    if len(capacities) not in (0, 1, len(chosen)):
        raise ValueError(f"--dynamic_capacity={_joined(capacities)} gives "
                         f"{len(capacities)} capacities for {len(chosen)} dynamic tables; "
                         "give one for all of them or one per table, in feature order")
    for name in ("dynamic_admit_after", "dynamic_ttl_steps", "dynamic_stats_every"):
        if getattr(config, name) is not None:
            _positive(name, getattr(config, name))
    if config.dynamic_evict is not None and config.dynamic_evict not in EVICT_CHOICES:
        raise ValueError(f"--dynamic_evict={config.dynamic_evict!r} is unknown; expected one "
                         f"of {', '.join(EVICT_CHOICES)}")
    flag = "--embedding_optimizer" if config.embedding_optimizer else "--optimizer"
    optimizer = config.embedding_optimizer or config.optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--dynamic_tables={shown} needs the tables trained by "
                         f"{', '.join(OPTIMIZERS)} ({flag}={optimizer!r} keeps a slot per "
                         "entry, which would outlive the entry's key when it is evicted); "
                         f"set --embedding_optimizer to one of them")
    # features that hold rows by fixed ids, or copy whole tables by row
    for other, why in (("fiited_target", "FIITED's widths belong to rows of fixed ids"),
                       ("dram_budget", "the disk tier holds tables by row"),
                       ("export_dir", "the serving export copies whole tables by row; "
                                      "save a --checkpoint_dir instead")):
        if getattr(config, other) is not None:
            raise ValueError(f"--dynamic_tables={shown} and --{other}="
                             f"{getattr(config, other)} exclude each other: {why}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{name}={value!r} must be an integer >= 1")


def _joined(values: Sequence[Any]) -> str:
    return ",".join(str(v) for v in values)


def table_options(config: Any, table_rows: Sequence[int]) -> dict[int, dict]:
    """{feature index: DynamicEmbedding options} of ``config``'s dynamic tables (a
    model's ``dynamic``); a table's capacity defaults to its fixed table's rows."""
    chosen = features(config.dynamic_tables, config.dataset)
    capacities = list(config.dynamic_capacity or ())
    if len(capacities) == 1:
        capacities = capacities * len(chosen)
    evict = config.dynamic_evict or DEFAULT_EVICT
    return {t: {"capacity": int(capacities[i]) if capacities else int(table_rows[t]),
                "admit_after": config.dynamic_admit_after or 1,
                "evict": None if evict == "none" else evict,
                "ttl_steps": config.dynamic_ttl_steps}
            for i, t in enumerate(chosen)}


def totals(stats: dict[str, dict]) -> dict[str, Any]:
    """``table_stats()`` summed over the dynamic tables, with the overall hit rate.

    >>> totals({"a": {"size": 3, "capacity": 4, "admissions": 5, "evictions": 2,
    ...               "refusals": 0, "hits": 6, "misses": 2, "candidates": 0},
    ...         "b": {"size": 1, "capacity": 4, "admissions": 1, "evictions": 0,
    ...               "refusals": 0, "hits": 1, "misses": 1, "candidates": 0}})["hit_rate"]
    0.7
    """
    summed = {name: sum(int(s[name]) for s in stats.values()) for name in SUMMED}
    looked = summed["hits"] + summed["misses"]
    summed["hit_rate"] = summed["hits"] / looked if looked else 0.0
    summed["tables"] = len(stats)
    return summed


def describe(stats: dict[str, dict]) -> list[str]:
    """Lines for the run's report: the totals, then each table."""
    whole = totals(stats)
    lines = [f"dynamic tables ({whole['tables']}): {whole['size']:,} of {whole['capacity']:,} "
             f"rows held, {whole['admissions']:,} admissions, {whole['evictions']:,} "
             f"evictions, {whole['refusals']:,} refusals, hit rate {whole['hit_rate']:.4f}"]
    for name, table in stats.items():
        lines.append(f"  {name}: {table['size']:,}/{table['capacity']:,} rows, "
                     f"{table['admissions']:,} admitted, {table['evictions']:,} evicted, "
                     f"{table['refusals']:,} refused, hit rate {table['hit_rate']:.4f}")
    return lines
