"""Input pipelines of the training app: synthetic Criteo-like clicks (closed or open-world),
Criteo TSV, MovieLens-100k.

One module for all datasets because they share one sharding contract (below) and one
element format; each dataset is a few functions that follow it.

Every dataset gives ``tf.data`` elements ``({"dense": float32 [b, dense_features],
"categorical": int32 [b, n_cat]}, labels float32 [b, 1])`` where ``b = global_batch_size //
size`` is this rank's local batch. Batches have static shapes (the remainder is dropped).

Sharding contract: global batch k is the concatenation, in rank order, of the k-th local
batch of ranks 0..size-1. A 1-process run and an N-process run therefore see exactly the
same global batches, which is what lets results be compared across process counts.

``dataset_spec(name, ...)`` describes a dataset (widths, table rows, feature names) without
building a pipeline; ``make_dataset(name, split, ...)`` builds one. ``split`` is ``"train"``
or ``"eval"``. With ``num_batches`` a dataset yields exactly that many global batches for
train (repeating the data when it runs out) and at most that many for eval.

synthetic
    Criteo-1TB-like: 13 dense and 26 categorical features whose table sizes are
    ``CRITEO_1TB_CARDINALITIES`` times ``cardinality_scale`` (rounded; a table never
    shrinks below ``min(original, 4)`` rows), then capped at ``max_table_rows``. Ids are
    Zipf-distributed (a truncated power law with a per-table exponent in [1.05, 1.2],
    drawn by inverse CDF) and scattered over the table by a per-table affine permutation,
    so the hot ids are not 0, 1, 2, ... Dense features are ``log(1 + count)`` of
    log-normal counts. Labels are Bernoulli draws from a planted teacher that depends only
    on ``seed``: a hashed weight per (table, id), a linear term on the dense features' latent
    values and one pairwise (table 2 id x table 4 id) term, its bias solved so the base CTR
    is 25% and its scale giving a teacher AUC near 0.8. Nothing is stored: every number
    is a stateless hash (splitmix64) of (seed, split, field, global sample index), so
    sample i of a split is the same whatever the batch size or process count, and each rank
    computes only its own rows. Train is an endless stream; eval is the first
    ``SYNTHETIC_EVAL_SAMPLES`` (2**16) samples of a separate stream, rounded down to whole
    global batches (at least one). ``DatasetSpec.best_auc`` is the teacher's own AUC
    (its probabilities scored against the sampled labels) on those 2**16 eval samples: the
    best AUC any model can expect there.

synthetic_open
    ``synthetic``'s samples and planted teacher over an open world of raw 64-bit keys
    (:class:`OpenWorldTeacher`): table t has ``rows[t]`` (as ``synthetic``'s) slots drawn
    by the same per-table Zipf law; a slot holds a key (a hash of the seed, table, slot
    and the slot's generation: any int64, negative ones included) for
    ``open_key_lifetime`` samples of stream time (default ``OPEN_KEY_LIFETIME`` = 2**19),
    then a new key takes it, each slot at its own phase; tables of fewer than
    ``OPEN_STABLE_BELOW`` (100) slots keep their keys. So new keys, hot ones among them,
    keep arriving and old ones go cold, and the distinct keys grow with the steps. The
    teacher weighs each key by a hash of it (a new key is a new unknown). Stream time is
    the global sample index for train; eval is ``synthetic``'s eval draw (2**16 samples
    of a separate stream) at times ``eval_start``, +1, ...: the app passes the samples
    trained on, so eval is the traffic that follows training. Without raw keys a key
    becomes the row ``key mod rows[t]`` (the hashing trick, as criteo_tsv's hex ids).
    ``best_auc(..., eval_start=...)`` is the teacher's own AUC there.

criteo_tsv
    Criteo's day_N format: per line a 0/1 label, 13 integer fields and 26 hexadecimal
    fields, tab separated; every field but the label may be empty. Dense value
    ``log(1 + max(x, 0))`` (empty = 0); categorical id ``int(hex, 16) % table_rows``
    (empty = id 0). Table rows are those of ``synthetic`` (same scaling and capping), so
    ``dataset_spec`` needs no scan of the data. Files: names ``day_*`` or ``*.tsv``, either
    optionally gzipped (``.gz``), read in natural order (day_2 before day_10), their lines
    forming one stream; consecutive valid lines form the global batches. Layout of
    ``data_dir``: if it has ``train/`` and ``eval/`` subfolders, each split is the data files
    there; otherwise the data files sit in ``data_dir`` itself, the last one (e.g. day_23,
    as in MLPerf) is eval and the others are train. One pass per iteration; with
    ``num_batches`` train passes repeat, each dropping its own remainder.

    A malformed line (not 40 fields, label not 0/1, an integer field that is not an
    optional ``-`` and 1 to 18 digits, a non-hexadecimal categorical field) raises
    ``ValueError("<path>, line <n>: <what was wrong>")`` while the dataset is iterated
    (tf.data re-raises it as ``tf.errors.InvalidArgumentError`` or ``UnknownError`` whose
    message holds the same text). Every rank validates every line, so all ranks fail at
    the same batch. With ``skip_malformed=True`` such lines are skipped and counted
    instead: ``parse_stats(dataset)`` of the returned dataset is a live
    :class:`ParseStats` (lines read, examples kept, lines skipped, the first problem); read
    ``parse_stats(dataset).malformed`` after iterating. It covers everything that dataset
    object has read, over all its iterations (prefetching reads a little ahead); keep a
    reference to it, since datasets derived with ``.repeat()``, ``.map()``... have none.

criteo_binary
    Criteo preprocessed once by ``python -m tfhybrid.train.preprocess`` into fixed-width
    columns (``data_dir/train``, ``data_dir/eval``; format:
    :mod:`tfhybrid.train.criteo_binary`), memory-mapped: each rank reads only its own
    slice of each global batch, with no per-line Python. With hashed ids (the default) a
    rank's batches equal ``criteo_tsv``'s from the TSV it came from; with vocabulary ids
    the tables have the vocabulary's rows. Global batch k depends on k alone, so skipping
    k batches (a resumed run) reads nothing.

movielens
    MovieLens-100k from the recbole 1.2.1 wheel, fetched into ``data_dir`` (default
    ``~/.cache/tfhybrid/data/ml-100k``) on first use, see :func:`fetch_movielens`. Click = rating >= 4. Categorical: user id, item
    id, gender, occupation, zip prefix (first character, non-digits share one id), age
    bucket (<18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+) and release decade (unknown = 0),
    raw tokens mapped to contiguous ids in sorted order (and taken modulo
    ``max_table_rows`` if capped; ``cardinality_scale`` does not apply). Dense (20):
    standardized age and the 19 genre flags. Split: a seeded random permutation of the
    100,000 ratings; its first 20% is eval and the rest train, both in permuted order. One
    pass per iteration.

Raw keys (``raw_keys``, the app's ``--dynamic_tables``): the listed categorical columns
are given as int64 keys for dynamic tables, not taken modulo any rows, and the
``categorical`` block is int64. ``synthetic``: the ids themselves; ``synthetic_open``: its
keys; ``criteo_tsv``: the hex value (Criteo's 8 digits: the 32-bit value; a raw column's
field with more than ``RAW_KEY_HEX_DIGITS`` (15) digits is malformed there, so values stay
below 2**60) and ``EMPTY_FIELD_KEY`` (-1) for an empty field, which no value shares;
``movielens``: the contiguous ids, uncapped. ``criteo_binary`` gives none: it stores an
empty field as the value 0.

Command line: ``python -m tfhybrid.train.data --fetch movielens [--data_dir DIR]`` downloads
MovieLens-100k and prints the folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import math
import numbers
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
import weakref
import zipfile
from typing import Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf

from tfhybrid.train import criteo_binary
from tfhybrid.train.metrics import roc_auc

DATASETS = ("synthetic", "synthetic_open", "criteo_tsv", "criteo_binary", "movielens")
# the datasets whose categorical columns can be fed as raw int64 keys (``raw_keys``):
# criteo_binary stores an empty field as the value 0, so its keys would merge the two
RAW_KEY_DATASETS = ("synthetic", "synthetic_open", "criteo_tsv", "movielens")
# criteo_tsv's raw key of an empty categorical field: below every parsed value (>= 0)
EMPTY_FIELD_KEY = -1
# a raw key's hex field has at most this many digits: its value is then below 2**60, a
# non-negative int64 that no other field's text shares and EMPTY_FIELD_KEY is not
RAW_KEY_HEX_DIGITS = 15
SPLITS = ("train", "eval")

# Rows of the 26 categorical tables of Criteo 1TB click logs (the MLPerf DLRM sizes).
CRITEO_1TB_CARDINALITIES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36)
CRITEO_DENSE_FEATURES = 13
CRITEO_FEATURE_NAMES = tuple(f"C{i + 1}" for i in range(len(CRITEO_1TB_CARDINALITIES)))
SYNTHETIC_EVAL_SAMPLES = 2 ** 16
# synthetic_open: samples of stream time a drifting table's key lives (512 global batches
# of 1024), and the tables below this many slots, which keep their keys (attributes such
# as a device type do not turn over)
OPEN_KEY_LIFETIME = 2 ** 19
OPEN_STABLE_BELOW = 100

MOVIELENS_FEATURE_NAMES = ("user_id", "item_id", "gender", "occupation", "zip_prefix",
                           "age_bucket", "release_decade")
MOVIELENS_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy",
                    "Crime", "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror",
                    "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
MOVIELENS_EVAL_FRACTION = 0.2
_MOVIELENS_FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
_RECBOLE_WHEEL = "recbole==1.2.1"
_RECBOLE_MEMBER_DIR = "recbole/dataset_example/ml-100k/"
_AGE_BOUNDS = (18, 25, 35, 45, 50, 56)   # MovieLens-1M's age groups


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a model needs to know about a dataset's features."""

    name: str                       # "synthetic" | "criteo_tsv" | "movielens"
    dense_features: int             # width of features["dense"]
    table_rows: tuple[int, ...]     # rows of each categorical column's table (capped)
    feature_names: tuple[str, ...]  # one per categorical column
    best_auc: float | None = None   # synthetic only: the planted teacher's AUC on eval


@dataclasses.dataclass
class ParseStats:
    """Counts of a criteo_tsv dataset's parsing, updated live while it is iterated."""

    lines: int = 0                  # lines read (valid or not)
    examples: int = 0               # valid lines
    malformed: int = 0              # lines skipped as malformed (skip_malformed=True)
    first_malformed: str | None = None  # "<path>, line <n>: <reason>" of the first one


# each criteo_tsv dataset's counts, held as long as the dataset (facts about a
# tf.data object live here, not as attributes on it)
_PARSE_STATS: "weakref.WeakKeyDictionary[tf.data.Dataset, ParseStats]" = \
    weakref.WeakKeyDictionary()


def parse_stats(dataset: tf.data.Dataset) -> ParseStats | None:
    """The live :class:`ParseStats` of a ``criteo_tsv`` dataset ``make_dataset`` returned
    (None for any other dataset, a derived one included)."""
    return _PARSE_STATS.get(dataset)


# --------------------------------------------------------------------------- arguments

def _check_common(name: str, max_table_rows: int | None, cardinality_scale: float) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    if max_table_rows is not None and (not isinstance(max_table_rows, (int, np.integer))
                                       or max_table_rows < 1):
        raise ValueError(f"max_table_rows={max_table_rows!r}; expected a positive integer "
                         "or None")
    if not (isinstance(cardinality_scale, numbers.Real) and cardinality_scale > 0
            and math.isfinite(cardinality_scale)):
        raise ValueError(f"cardinality_scale={cardinality_scale!r}; expected a positive "
                         "finite number")


def _local_batch(global_batch_size: int, rank: int, size: int) -> int:
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size={size!r}; expected a positive integer")
    if not isinstance(global_batch_size, (int, np.integer)) or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size!r}; expected a positive "
                         "integer")
    if global_batch_size % size:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                         f"size={size}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < size:
        raise ValueError(f"rank={rank!r}; expected an integer in [0, size={size})")
    return int(global_batch_size // size)


def scaled_cardinalities(cardinality_scale: float = 1e-3, max_table_rows: int | None = None
                         ) -> tuple[int, ...]:
    """Criteo-1TB table sizes times ``cardinality_scale``, then capped at ``max_table_rows``.

    A table never shrinks below ``min(original, 4)`` rows, so tiny tables (3, 4, 10 rows)
    keep a few distinct values at any scale.
    """
    _check_common("synthetic", max_table_rows, cardinality_scale)
    rows = []
    for original in CRITEO_1TB_CARDINALITIES:
        n = max(int(round(original * cardinality_scale)), min(original, 4))
        if max_table_rows is not None:
            n = min(n, int(max_table_rows))
        rows.append(n)
    return tuple(rows)


# --------------------------------------------------------------------------- specs

def dataset_spec(name: str, *, data_dir: str | None = None, max_table_rows: int | None = None,
                 cardinality_scale: float = 1e-3, seed: int = 0) -> DatasetSpec:
    """Describes dataset ``name`` (see the module docstring) without building a pipeline.

    ``synthetic`` computes ``best_auc`` on first use (a fraction of a second; cached per
    seed and table sizes); ``synthetic_open``'s depends on when it is evaluated
    (:func:`best_auc`), so its spec has none. ``movielens`` reads (and if needed fetches)
    the files in ``data_dir``.
    """
    _check_common(name, max_table_rows, cardinality_scale)
    if name == "movielens":
        ml = _movielens(fetch_movielens(data_dir), int(seed))
        return DatasetSpec(name, ml.dense.shape[1], _capped(ml.table_rows, max_table_rows),
                           MOVIELENS_FEATURE_NAMES)
    rows = scaled_cardinalities(cardinality_scale, max_table_rows)
    if name == "criteo_binary":
        rows = tuple(int(r) for r in _criteo_binary_split(data_dir, "train", rows,
                                                          max_table_rows).rows)
    best = SyntheticTeacher(int(seed), rows).best_auc() if name == "synthetic" else None
    return DatasetSpec(name, CRITEO_DENSE_FEATURES, rows, CRITEO_FEATURE_NAMES, best)


def feature_names(name: str) -> tuple[str, ...]:
    """The names of dataset ``name``'s categorical columns, in order (no data read)."""
    _check_common(name, None, 1.0)
    return MOVIELENS_FEATURE_NAMES if name == "movielens" else CRITEO_FEATURE_NAMES


def best_auc(name: str, *, eval_start: int = 0, max_table_rows: int | None = None,
             cardinality_scale: float = 1e-3, seed: int = 0,
             open_key_lifetime: int = OPEN_KEY_LIFETIME) -> float | None:
    """The planted teacher's AUC on the eval split (None for data without a teacher).

    ``synthetic_open`` is evaluated at the stream's time ``eval_start`` (the training
    samples before it: its keys are the ones alive then), so its figure depends on it.
    """
    _check_common(name, max_table_rows, cardinality_scale)
    rows = scaled_cardinalities(cardinality_scale, max_table_rows)
    if name == "synthetic":
        return SyntheticTeacher(int(seed), rows).best_auc()
    if name == "synthetic_open":
        return _open_teacher(int(seed), rows, int(open_key_lifetime)).best_auc(
            eval_start=int(eval_start))
    return None


def _capped(rows: Sequence[int], max_table_rows: int | None) -> tuple[int, ...]:
    if max_table_rows is None:
        return tuple(int(r) for r in rows)
    return tuple(min(int(r), int(max_table_rows)) for r in rows)


def make_dataset(name: str, split: str, *, global_batch_size: int, rank: int = 0, size: int = 1,
                 data_dir: str | None = None, max_table_rows: int | None = None,
                 cardinality_scale: float = 1e-3, seed: int = 0, skip_malformed: bool = False,
                 num_batches: int | None = None, raw_keys: Sequence[int] = (),
                 eval_start: int = 0, open_key_lifetime: int = OPEN_KEY_LIFETIME
                 ) -> tf.data.Dataset:
    """This rank's local batches of dataset ``name``, split ``split`` (``"train"``/``"eval"``).

    Elements are ``({"dense": float32 [b, d], "categorical": int32 [b, n_cat]},
    labels float32 [b, 1])`` with ``b = global_batch_size // size``; global batch k is the
    rank-ordered concatenation of every rank's k-th element. ``num_batches`` fixes the
    number of global batches for train (repeating data) and caps it for eval. Bad
    arguments raise ``ValueError`` naming the value. A ``criteo_tsv`` dataset's
    :class:`ParseStats` is ``parse_stats(dataset)``. See the module docstring for each
    dataset's contents, splits and layout.

    ``raw_keys`` lists categorical columns (by index) given as raw keys for dynamic
    tables instead of row ids (see "Raw keys" in the module docstring); with any, the
    whole ``categorical`` column block is int64. ``eval_start`` and
    ``open_key_lifetime`` shape ``synthetic_open`` only: the stream time its eval split
    is drawn at, and how many samples a key of a drifting table lives.
    """
    _check_common(name, max_table_rows, cardinality_scale)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    local = _local_batch(global_batch_size, rank, size)
    if num_batches is not None and (not isinstance(num_batches, (int, np.integer))
                                    or num_batches < 1):
        raise ValueError(f"num_batches={num_batches!r}; expected a positive integer or None")
    raw = check_raw_keys(name, raw_keys)
    for label, value, low in (("eval_start", eval_start, 0),
                              ("open_key_lifetime", open_key_lifetime, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{label}={value!r}; expected an integer >= {low}")
    rank, size, seed = int(rank), int(size), int(seed)
    if name in ("synthetic", "synthetic_open"):
        rows = scaled_cardinalities(cardinality_scale, max_table_rows)
        return _teacher_dataset(name, split, global_batch_size, rank, local, rows, seed,
                                num_batches, raw, int(eval_start), int(open_key_lifetime))
    if name == "criteo_tsv":
        rows = scaled_cardinalities(cardinality_scale, max_table_rows)
        files = criteo_files(data_dir, split)
        return _criteo_dataset(files, split, global_batch_size, rank, local, rows,
                               skip_malformed, num_batches, raw)
    if name == "criteo_binary":
        rows = scaled_cardinalities(cardinality_scale, max_table_rows)
        return _criteo_binary_dataset(_criteo_binary_split(data_dir, split, rows,
                                                           max_table_rows),
                                      split, global_batch_size, rank, local, num_batches)
    return _movielens_dataset(fetch_movielens(data_dir), split, global_batch_size, rank,
                              local, max_table_rows, seed, num_batches, raw)


def check_raw_keys(name: str, raw_keys: Sequence[int]) -> tuple[int, ...]:
    """``raw_keys`` as a sorted tuple of column indices of dataset ``name``; ValueError
    naming the value when the dataset takes none or an index is out of range."""
    try:
        raw = tuple(sorted({operator.index(c) for c in raw_keys}))
    except TypeError:
        raise ValueError(f"raw_keys={raw_keys!r}; expected categorical column indices"
                         ) from None
    if not raw:
        return raw
    if name not in RAW_KEY_DATASETS:
        raise ValueError(f"dataset {name!r} gives no raw keys (raw_keys={list(raw)}): "
                         f"criteo_binary stores an empty field as the value 0; raw keys "
                         f"come from {', '.join(RAW_KEY_DATASETS)}")
    columns = len(feature_names(name))
    bad = [c for c in raw if not 0 <= c < columns]
    if bad:
        raise ValueError(f"raw_keys={list(raw)}: {bad} not categorical columns of {name!r}, "
                         f"which has {columns} (0 to {columns - 1})")
    return raw


def _signature(local: int, dense: int, n_cat: int, raw: Sequence[int] = ()):
    return ({"dense": tf.TensorSpec([local, dense], tf.float32),
             "categorical": tf.TensorSpec([local, n_cat], tf.int64 if raw else tf.int32)},
            tf.TensorSpec([local, 1], tf.float32))


# --------------------------------------------------------------------------- hashing

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15   # splitmix64's increment (odd, so i -> i * gamma is a bijection)


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on one Python int (for deriving keys)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _key(*parts: int) -> int:
    """A 64-bit key from small integers; different part tuples give unrelated keys."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix_int(h ^ _mix_int(int(p) + _GAMMA))
    return h


_U30, _U27, _U31, _U16 = (np.uint64(k) for k in (30, 27, 31, 16))
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GAMMA_U = np.uint64(_GAMMA)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping multiplication is intended)."""
    x = x ^ (x >> _U30)
    x *= _C1
    x ^= x >> _U27
    x *= _C2
    x ^= x >> _U31
    return x


def _hash(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Counter-mode splitmix64: element [i, j] hashes counter i under key j."""
    with np.errstate(over="ignore"):
        return _mix(counters.astype(np.uint64)[:, None] * _GAMMA_U + keys[None, :])


def _uniform(h: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) from the top 53 bits."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _normalish(h: np.ndarray) -> np.ndarray:
    """Mean 0, variance 1: the sum of four 16-bit uniforms (Irwin-Hall), one hash each."""
    m = np.uint64(0xFFFF)
    s = ((h & m) + ((h >> _U16) & m) + ((h >> np.uint64(32)) & m) + (h >> np.uint64(48)))
    return (s.astype(np.float64) + 2.0) * (1.0 / 65536) * math.sqrt(3.0) - 2.0 * math.sqrt(3.0)


# --------------------------------------------------------------------------- synthetic

_SPLIT_ID = {"train": 0, "eval": 1, "calibrate": 2}   # "calibrate" only fixes the bias
_TARGET_CTR = 0.25
_CALIBRATION_SAMPLES = 16384
_PAIR_TABLES = (2, 4)          # the teacher's one pairwise term
# logit = bias + CAT * sum_t c_t w_t(id_t) + DENSE * sum_f d_f z_f + PAIR * v(id_2) v(id_4),
# each term of unit variance; scaled so the teacher's AUC is ~0.8. The bias is solved per
# teacher so the base CTR is _TARGET_CTR whatever the seed: with Zipf ids a few hot ids'
# weights shift the mean logit a lot.
_TEACHER_CAT, _TEACHER_DENSE, _TEACHER_PAIR = 1.25, 0.7, 0.6


class SyntheticTeacher:
    """The synthetic dataset's generator and planted click model for one seed and the
    rows of Criteo's 26 tables.

    Example::

        >>> teacher = SyntheticTeacher(seed=0, rows=scaled_cardinalities(1e-4))
        >>> dense, ids, labels, probabilities = teacher.generate("eval", 0, 4)
        >>> dense.shape, ids.shape, labels.shape
        ((4, 13), (4, 26), (4, 1))
    """

    def __init__(self, seed: int, rows: tuple[int, ...]):
        self.seed, self.rows = seed, rows
        n_cat = len(rows)
        t = np.arange(n_cat)
        param = lambda tag, n: _uniform(_hash(np.array([_key(seed, tag)], np.uint64),  # noqa: E731
                                              np.arange(n))[:, 0])
        self.n = np.array(rows, np.float64)
        self.rows_i = np.array(rows, np.int64)
        # Zipf exponent per table and the inverse-CDF constant (N+1)^(1-s) - 1
        self.exponent = 1.05 + 0.15 * param(1, n_cat)
        self.one_minus_s = 1.0 - self.exponent
        self.span = (self.n + 1.0) ** self.one_minus_s - 1.0
        # affine permutation id = (a * rank + c) mod N with gcd(a, N) = 1
        a = np.floor(param(2, n_cat) * self.n).astype(np.int64)
        c = np.floor(param(3, n_cat) * self.n).astype(np.int64)
        for i, n in enumerate(rows):
            a[i] = max(int(a[i]), 1)
            while math.gcd(int(a[i]), n) != 1:
                a[i] += 1
        self.perm_a, self.perm_c = a, c
        # dense counts: floor(exp(mu + sigma z)) - 1, clipped at 0
        self.mu = 0.5 + 3.0 * param(4, CRITEO_DENSE_FEATURES)
        self.sigma = 0.6 + 0.9 * param(5, CRITEO_DENSE_FEATURES)
        # teacher weights: per-table importance c_t and per-feature d_f, each of unit norm
        cat_w = 0.2 + 0.8 * param(6, n_cat)
        self.cat_w = _TEACHER_CAT * cat_w / np.linalg.norm(cat_w)
        dense_w = param(7, CRITEO_DENSE_FEATURES) * 2.0 - 1.0
        self.dense_w = _TEACHER_DENSE * dense_w / np.linalg.norm(dense_w)
        self.id_keys = np.array([_key(seed, 8, i) for i in t], np.uint64)
        self.pair_keys = np.array([_key(seed, 9, i) for i in range(2)], np.uint64)
        n_fields = CRITEO_DENSE_FEATURES + n_cat + 1   # dense, ids, label
        self.sample_keys = {split: np.array([_key(seed, 10, i, f) for f in range(n_fields)],
                                            np.uint64) for split, i in _SPLIT_ID.items()}
        self._best_auc: float | None = None
        raw = self._draw("calibrate", 0, _CALIBRATION_SAMPLES)[2]
        low, high = -20.0, 20.0
        for _ in range(60):   # bisection: mean sigmoid(bias + raw) is increasing in bias
            mid = 0.5 * (low + high)
            low, high = (mid, high) if np.mean(1 / (1 + np.exp(-(mid + raw)))) < _TARGET_CTR \
                else (low, mid)
        self.bias = 0.5 * (low + high)

    def _draw(self, split: str, start: int, count: int, time_start: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Samples start..start+count-1: dense, ids, logits less the bias, label uniforms.
        ``time_start``: the stream time of sample ``start`` (default ``start``), which
        only an open-world teacher's keys depend on."""
        h = _hash(self.sample_keys[split], np.arange(start, start + count, dtype=np.int64))
        nd = CRITEO_DENSE_FEATURES
        z = _normalish(h[:, :nd])
        counts = np.maximum(np.floor(np.exp(self.mu + self.sigma * z)) - 1.0, 0.0)
        dense = np.log1p(counts).astype(np.float32)
        u = _uniform(h[:, nd:-1])
        # inverse CDF of p(x) ~ x^-s on [1, N+1): x = (1 + u ((N+1)^(1-s) - 1))^(1/(1-s))
        x = (1.0 + u * self.span) ** (1.0 / self.one_minus_s)
        rank = np.maximum(np.minimum(x.astype(np.int64) - 1, self.rows_i - 1), 0)
        ids = self._ids(rank, start if time_start is None else time_start)
        logit = z @ self.dense_w + _normalish(_hash_ids(self.id_keys, ids)) @ self.cat_w
        a, b = _PAIR_TABLES
        pair = _normalish(_hash_ids(self.pair_keys, ids[:, [a, b]]))
        logit += _TEACHER_PAIR * pair[:, 0] * pair[:, 1]
        return dense, self._output_ids(ids), logit, _uniform(h[:, -1])

    def _ids(self, rank: np.ndarray, time_start: int) -> np.ndarray:
        """The ids of popularity ranks ``rank`` [n, tables]: scattered over each table by
        its affine permutation, the same at every time."""
        return (self.perm_a * rank + self.perm_c) % self.rows_i

    def _output_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids.astype(np.int32)

    def generate(self, split: str, start: int, count: int, time_start: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Samples start..start+count-1 of ``split``: dense, ids, labels, click
        probabilities (``time_start``: see ``_draw``)."""
        dense, ids, logit, u = self._draw(split, start, count, time_start)
        prob = 1.0 / (1.0 + np.exp(-(self.bias + logit)))
        labels = (u < prob).astype(np.float32)[:, None]
        return dense, ids, labels, prob

    def best_auc(self) -> float:
        """The teacher's AUC on the first SYNTHETIC_EVAL_SAMPLES eval samples (cached)."""
        if self._best_auc is not None:
            return self._best_auc
        labels, probs = [], []
        step = 8192
        for start in range(0, SYNTHETIC_EVAL_SAMPLES, step):
            _, _, y, p = self.generate("eval", start, step)
            labels.append(y[:, 0])
            probs.append(p)
        self._best_auc = roc_auc(np.concatenate(labels), np.concatenate(probs))
        return self._best_auc


def _hash_ids(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Element [i, t] hashes id ids[i, t] under key keys[t]."""
    with np.errstate(over="ignore"):
        return _mix(ids.astype(np.uint64) * _GAMMA_U + keys[None, :])


class OpenWorldTeacher(SyntheticTeacher):
    """``synthetic_open``'s generator and planted click model: :class:`SyntheticTeacher`'s
    samples and teacher, with raw 64-bit keys whose universe drifts (module docstring).

    Table t has ``rows[t]`` slots, drawn by the same Zipf law as ``synthetic``'s ids.
    A slot of a table with at least ``OPEN_STABLE_BELOW`` slots holds a key for
    ``key_lifetime`` samples of stream time, then a new key takes it (each slot at its
    own phase, so a table renews ``rows[t] / key_lifetime`` keys per sample); a smaller
    table keeps its keys. The teacher weighs each key by a hash of it, so a new key is
    a new unknown to learn.

    Example::

        >>> teacher = OpenWorldTeacher(seed=0, rows=scaled_cardinalities(1e-4), key_lifetime=64)
        >>> _, early, _, _ = teacher.generate("train", 0, 256)
        >>> _, late, _, _ = teacher.generate("train", 0, 256, time_start=10**6)
        >>> early.dtype, bool((early[:, 0] != late[:, 0]).any())   # C1 drifts
        (dtype('int64'), True)
        >>> bool((early[:, 5] == late[:, 5]).all())                 # C6 keeps its 3 keys
        True
    """

    def __init__(self, seed: int, rows: tuple[int, ...],
                 key_lifetime: int = OPEN_KEY_LIFETIME):
        if isinstance(key_lifetime, bool) or not isinstance(key_lifetime, (int, np.integer)) \
                or key_lifetime < 1:
            raise ValueError(f"key_lifetime={key_lifetime!r}; expected an integer >= 1")
        # set before SyntheticTeacher.__init__, whose bias calibration draws keys
        self.key_lifetime = np.uint64(key_lifetime)
        self.drifts = np.array([r >= OPEN_STABLE_BELOW for r in rows])
        self.slot_keys = np.array([_key(seed, 11, t) for t in range(len(rows))], np.uint64)
        self.phase_keys = np.array([_key(seed, 12, t) for t in range(len(rows))], np.uint64)
        self._open_best: dict[int, float] = {}
        super().__init__(seed, rows)

    def _ids(self, rank: np.ndarray, time_start: int) -> np.ndarray:
        """The uint64 keys of slots ``rank`` [n, tables] at times time_start, +1, ...:
        a hash of (table, slot, generation), the generation counting the slot's
        renewals by then."""
        times = np.arange(time_start, time_start + len(rank), dtype=np.uint64)[:, None]
        slot = _hash_ids(self.slot_keys, rank)
        phase = _hash_ids(self.phase_keys, rank) % self.key_lifetime
        generation = np.where(self.drifts, (times + phase) // self.key_lifetime,
                              np.uint64(0))
        with np.errstate(over="ignore"):
            return _mix(slot + generation * _GAMMA_U)

    def _output_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids.view(np.int64)   # the same 64 bits, any sign: raw keys

    def best_auc(self, eval_start: int = 0) -> float:
        """The teacher's AUC on the first SYNTHETIC_EVAL_SAMPLES eval samples drawn at
        stream times ``eval_start``, +1, ... (cached per ``eval_start``)."""
        if eval_start not in self._open_best:
            labels, probs = [], []
            step = 8192
            for start in range(0, SYNTHETIC_EVAL_SAMPLES, step):
                _, _, y, p = self.generate("eval", start, step, eval_start + start)
                labels.append(y[:, 0])
                probs.append(p)
            self._open_best[eval_start] = roc_auc(np.concatenate(labels),
                                                  np.concatenate(probs))
        return self._open_best[eval_start]

    def distinct_keys(self, samples: int, chunk: int = 65536) -> list[int]:
        """Per table, the distinct keys among training samples 0..samples-1."""
        seen: list[np.ndarray] = [np.zeros(0, np.int64) for _ in self.rows]
        for start in range(0, samples, chunk):
            ids = self.generate("train", start, min(chunk, samples - start))[1]
            seen = [np.union1d(before, ids[:, t]) for t, before in enumerate(seen)]
        return [len(keys) for keys in seen]


@functools.lru_cache(maxsize=4)
def _open_teacher(seed: int, rows: tuple[int, ...], key_lifetime: int) -> OpenWorldTeacher:
    return OpenWorldTeacher(seed, rows, key_lifetime)


def open_distinct_keys(samples: int, *, max_table_rows: int | None = None,
                       cardinality_scale: float = 1e-3, seed: int = 0,
                       open_key_lifetime: int = OPEN_KEY_LIFETIME) -> list[int]:
    """Per categorical column, the distinct keys of ``synthetic_open``'s first
    ``samples`` training samples: the capacity a dynamic table needs to evict nothing in
    a run of that many samples."""
    rows = scaled_cardinalities(cardinality_scale, max_table_rows)
    return _open_teacher(int(seed), rows, int(open_key_lifetime)).distinct_keys(int(samples))


def _teacher_columns(ids: np.ndarray, rows: tuple[int, ...], raw: tuple[int, ...],
                     keyed: bool) -> np.ndarray:
    """The categorical block of a teacher's ``ids``: raw columns as int64 keys (row ids
    for ``synthetic``, keys for ``synthetic_open``), the others as row ids (an open key
    hashed into its table's rows, as criteo_tsv does with hex values)."""
    if not keyed:
        return ids.astype(np.int64) if raw else ids
    row_ids = (ids.view(np.uint64) % np.asarray(rows, np.uint64)).astype(np.int64)
    if not raw:
        return row_ids.astype(np.int32)
    row_ids[:, list(raw)] = ids[:, list(raw)]
    return row_ids


@functools.lru_cache(maxsize=8)
def _teacher_dataset(name: str, split: str, global_batch: int, rank: int, local: int,
                     rows: tuple[int, ...], seed: int, num_batches: int | None,
                     raw: tuple[int, ...], eval_start: int, key_lifetime: int
                     ) -> tf.data.Dataset:
    keyed = name == "synthetic_open"
    teacher = _open_teacher(seed, rows, key_lifetime) if keyed else SyntheticTeacher(seed, rows)
    if split == "train":
        batches = tf.data.Dataset.range(num_batches) if num_batches else tf.data.Dataset.counter()
    else:
        available = max(1, SYNTHETIC_EVAL_SAMPLES // global_batch)
        batches = tf.data.Dataset.range(min(available, num_batches or available))
    # eval follows training in the open stream's time (its keys are those alive then)
    time_offset = eval_start if (keyed and split == "eval") else 0
    id_dtype = tf.int64 if raw else tf.int32

    def make(k: np.int64):
        start = int(k) * global_batch + rank * local
        dense, ids, labels, _ = teacher.generate(split, start, local, time_offset + start)
        return dense, _teacher_columns(ids, rows, raw, keyed), labels

    def to_element(k):
        dense, ids, labels = tf.numpy_function(make, [k], [tf.float32, id_dtype, tf.float32],
                                               stateful=False)
        dense.set_shape([local, CRITEO_DENSE_FEATURES])
        ids.set_shape([local, len(rows)])
        labels.set_shape([local, 1])
        return {"dense": dense, "categorical": ids}, labels

    # numpy releases the GIL in its array loops, so two parallel calls overlap well
    return batches.map(to_element, num_parallel_calls=2, deterministic=True).prefetch(2)


# --------------------------------------------------------------------------- criteo tsv

_CRITEO_FIELDS = 1 + CRITEO_DENSE_FEATURES + len(CRITEO_1TB_CARDINALITIES)
_CRITEO_LINE = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t[0-9a-fA-F]*){26}")
_INT_FIELD = re.compile(r"-?[0-9]{1,18}")
_HEX_FIELD = re.compile(r"[0-9a-fA-F]*")
_DATA_FILE = re.compile(r"(day_.*|.*\.tsv)(\.gz)?")
# ASCII code -> hex digit value (lines are validated first, so other codes never occur)
_HEX_VALUE = np.zeros(128, np.int64)
_HEX_VALUE[[ord(c) for c in "0123456789abcdef"]] = np.arange(16)
_HEX_VALUE[[ord(c) for c in "ABCDEF"]] = np.arange(10, 16)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _data_files(folder: str) -> list[str]:
    names = [n for n in os.listdir(folder)
             if _DATA_FILE.fullmatch(n) and os.path.isfile(os.path.join(folder, n))]
    return [os.path.join(folder, n) for n in sorted(names, key=_natural_key)]


def criteo_files(data_dir: str | None, split: str) -> list[str]:
    """The files of a criteo_tsv split, in reading order (layout: see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if data_dir is None:
        raise ValueError("criteo_tsv needs data_dir=<folder of day_* / *.tsv files>, "
                         "got data_dir=None")
    if not os.path.isdir(data_dir):
        raise ValueError(f"criteo_tsv data_dir={data_dir!r} is not a folder")
    split_dirs = [os.path.join(data_dir, s) for s in SPLITS]
    if any(os.path.isdir(d) for d in split_dirs):
        folder = os.path.join(data_dir, split)
        files = _data_files(folder) if os.path.isdir(folder) else []
        if not files:
            raise ValueError(f"criteo_tsv: no day_* or *.tsv files in {folder!r} (data_dir "
                             f"{data_dir!r} has train/ or eval/ subfolders, so both must "
                             "hold data files)")
        return files
    files = _data_files(data_dir)
    if len(files) < 2:
        raise ValueError(f"criteo_tsv: data_dir={data_dir!r} holds {len(files)} day_* / *.tsv "
                         "file(s); expected at least 2 (the last one is eval) or train/ and "
                         "eval/ subfolders")
    return files[-1:] if split == "eval" else files[:-1]


def _open_binary(path: str):
    # bytes, not text: no decoding cost, and only b"\n" ends a line, so a stray "\r" inside
    # a line makes it malformed instead of splitting it
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


@functools.lru_cache(maxsize=16)
def _criteo_line(raw: tuple[int, ...]) -> "re.Pattern[bytes]":
    """A valid line's pattern; a raw key's field (columns ``raw``) has at most
    RAW_KEY_HEX_DIGITS digits."""
    if not raw:
        return _CRITEO_LINE
    keys = rb"\t[0-9a-fA-F]{0,%d}" % RAW_KEY_HEX_DIGITS
    return re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}" + b"".join(
        keys if t in raw else rb"\t[0-9a-fA-F]*"
        for t in range(len(CRITEO_1TB_CARDINALITIES))))


def _malformed_reason(raw: bytes, raw_keys: tuple[int, ...] = ()) -> str:
    fields = raw.decode("utf-8", errors="replace").split("\t")
    if len(fields) != _CRITEO_FIELDS:
        return (f"expected {_CRITEO_FIELDS} tab-separated fields (label, "
                f"{CRITEO_DENSE_FEATURES} integers, {len(CRITEO_1TB_CARDINALITIES)} hex), "
                f"got {len(fields)}")
    if fields[0] not in ("0", "1"):
        return f"label {fields[0]!r} is not 0 or 1"
    for i, field in enumerate(fields[1:1 + CRITEO_DENSE_FEATURES]):
        if field and not _INT_FIELD.fullmatch(field):
            return (f"integer field I{i + 1} {field!r} is not an integer (optional '-' and "
                    "1 to 18 digits) or empty")
    for i, field in enumerate(fields[1 + CRITEO_DENSE_FEATURES:]):
        if not _HEX_FIELD.fullmatch(field):
            return f"categorical field C{i + 1} {field!r} is not hexadecimal or empty"
        if i in raw_keys and len(field) > RAW_KEY_HEX_DIGITS:
            return (f"categorical field C{i + 1} {field!r} has {len(field)} hex digits; as "
                    f"a dynamic table's raw key it may have at most {RAW_KEY_HEX_DIGITS} "
                    "(Criteo's have 8)")
    return "unparseable line"


def _hex_mod(hex_fields: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """int(h, 16) % rows for a validated bytes array [n, t] (empty -> 0), vectorized."""
    width = hex_fields.dtype.itemsize
    codes = np.ascontiguousarray(hex_fields).view(np.uint8).reshape(*hex_fields.shape, width)
    value = np.zeros(hex_fields.shape, np.int64)
    # Horner's rule over the characters (the array pads short fields with zero bytes); up
    # to 15 hex digits fit in int64, longer fields are reduced modulo rows at every step
    reduce_each_step = width > 15
    for j in range(width):
        c = codes[..., j]
        step = value * 16 + _HEX_VALUE[np.minimum(c, 127)]
        value = np.where(c != 0, step % rows if reduce_each_step else step, value)
    return value if reduce_each_step else value % rows


def hex_values(hex_fields: np.ndarray) -> np.ndarray:
    """int(h, 16) as uint64 for a validated bytes array [n, t] of at most 16 hex digits
    (empty -> 0), vectorized; ``hex_values(h) % rows == _hex_mod(h, rows)``."""
    width = hex_fields.dtype.itemsize
    codes = np.ascontiguousarray(hex_fields).view(np.uint8).reshape(*hex_fields.shape, width)
    value = np.zeros(hex_fields.shape, np.uint64)
    for j in range(width):
        c = codes[..., j]
        value = np.where(c != 0, value * np.uint64(16)
                         + _HEX_VALUE[np.minimum(c, 127)].astype(np.uint64), value)
    return value


def criteo_columns(fields: list[list[bytes]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated criteo lines (split on tabs) as (labels float32 [n, 1], dense float32
    [n, 13] = log(1 + max(x, 0)) with empty = 0, categorical hex fields bytes [n, 26])."""
    table = np.array(fields, dtype=bytes).reshape(len(fields), _CRITEO_FIELDS)
    labels = (table[:, 0] == b"1").astype(np.float32)[:, None]
    ints = table[:, 1:1 + CRITEO_DENSE_FEATURES]
    ints = np.where(ints == b"", b"0", ints).astype(np.float64)
    dense = np.log1p(np.maximum(ints, 0.0)).astype(np.float32)
    return labels, dense, table[:, 1 + CRITEO_DENSE_FEATURES:]


def _parse_criteo_fields(fields: list[list[bytes]], rows: Sequence[int],
                         raw: tuple[int, ...] = ()
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Converts validated criteo lines (split on tabs) to (dense, ids, labels) arrays:
    ids int32 row ids, or with raw-key columns ``raw`` an int64 block holding those
    columns' keys (``hex_keys``) and the other columns' row ids."""
    labels, dense, hex_fields = criteo_columns(fields)
    ids = _hex_mod(hex_fields, np.asarray(rows, np.int64))
    if not raw:
        return dense, ids.astype(np.int32), labels
    ids[:, list(raw)] = hex_keys(hex_fields[:, list(raw)])
    return dense, ids, labels


def hex_keys(hex_fields: np.ndarray) -> np.ndarray:
    """Raw int64 keys of validated hex fields [n, t] of at most RAW_KEY_HEX_DIGITS
    digits: the field's value (Criteo's 8 digits: its 32-bit value), and
    EMPTY_FIELD_KEY for an empty field (no value is negative, so none shares it).

    >>> hex_keys(np.array([[b"ff", b"", b"0"], [b"8000000A", b"00", b"fffffffff"]])).tolist()
    [[255, -1, 0], [2147483658, 0, 68719476735]]
    """
    keys = hex_values(hex_fields).astype(np.int64)
    return np.where(hex_fields == b"", np.int64(EMPTY_FIELD_KEY), keys)


def valid_criteo_lines(path: str, skip_malformed: bool, stats: ParseStats,
                       raw: tuple[int, ...] = ()) -> Iterator[bytes]:
    """The valid lines of one criteo TSV file (plain or gzip), without their line ends;
    a malformed line raises ``ValueError("<path>, line <n>: <what>")`` or, with
    ``skip_malformed``, is counted in ``stats`` and skipped. Columns ``raw`` are read as
    raw keys: more than RAW_KEY_HEX_DIGITS digits there is malformed."""
    pattern = _criteo_line(tuple(raw))
    with _open_binary(path) as f:
        for number, line in enumerate(f, 1):
            stats.lines += 1
            line = line.rstrip(b"\n")
            if line.endswith(b"\r"):   # Windows line ends
                line = line[:-1]
            if pattern.fullmatch(line) is None:
                message = f"{path}, line {number}: {_malformed_reason(line, tuple(raw))}"
                if not skip_malformed:
                    raise ValueError(message)
                stats.malformed += 1
                if stats.first_malformed is None:
                    stats.first_malformed = message
                continue
            stats.examples += 1
            yield line


def _criteo_batches(files: Sequence[str], global_batch: int, rank: int, local: int,
                    rows: tuple[int, ...], skip_malformed: bool, stats: ParseStats,
                    num_batches: int | None, repeat: bool, raw: tuple[int, ...] = ()
                    ) -> Iterator[tuple[dict, np.ndarray]]:
    lo, hi = rank * local, (rank + 1) * local
    emitted = 0
    while True:
        emitted_this_pass = 0
        position = 0          # valid lines so far in the current global batch
        mine: list[list[bytes]] = []
        for path in files:
            for line in valid_criteo_lines(path, skip_malformed, stats, raw):
                # every rank validates every line; only its own slice gets converted
                if lo <= position < hi:
                    mine.append(line.split(b"\t"))
                position += 1
                if position == global_batch:
                    dense, ids, labels = _parse_criteo_fields(mine, rows, raw)
                    yield {"dense": dense, "categorical": ids}, labels
                    mine, position = [], 0
                    emitted += 1
                    emitted_this_pass += 1
                    if num_batches is not None and emitted == num_batches:
                        return
        if not repeat:
            return
        if emitted_this_pass == 0:
            raise ValueError(f"criteo_tsv: {list(files)} hold no complete global batch of "
                             f"{global_batch} valid lines, so train cannot repeat them")


def _criteo_dataset(files: list[str], split: str, global_batch: int, rank: int, local: int,
                    rows: tuple[int, ...], skip_malformed: bool, num_batches: int | None,
                    raw: tuple[int, ...] = ()) -> tf.data.Dataset:
    stats = ParseStats()
    repeat = split == "train" and num_batches is not None
    dataset = tf.data.Dataset.from_generator(
        lambda: _criteo_batches(files, global_batch, rank, local, rows, skip_malformed,
                                stats, num_batches, repeat, raw),
        output_signature=_signature(local, CRITEO_DENSE_FEATURES, len(rows), raw)
    ).prefetch(2)
    _PARSE_STATS[dataset] = stats
    return dataset


# --------------------------------------------------------------------------- criteo binary

def _criteo_binary_split(data_dir, split: str, hashed_rows, max_table_rows):
    return criteo_binary.open_split(data_dir, split, CRITEO_DENSE_FEATURES,
                                    len(CRITEO_1TB_CARDINALITIES), hashed_rows, max_table_rows)


def _criteo_binary_dataset(columns: "criteo_binary.Split", split: str, global_batch: int,
                           rank: int, local: int, num_batches: int | None) -> tf.data.Dataset:
    """Global batch k is samples [k B, (k + 1) B) of the split (train repeats them, each
    pass dropping the remainder, as criteo_tsv does); this rank reads its slice."""
    available = columns.samples // global_batch
    if available == 0:
        raise ValueError(f"criteo_binary: {columns.folder} holds {columns.samples} samples, "
                         f"fewer than one global batch of {global_batch}")
    repeat = split == "train" and num_batches is not None
    count = num_batches if repeat else min(available, num_batches or available)

    def read(k):
        start = (int(k) % available) * global_batch + rank * local
        features, labels = columns.batch(start, local)
        return features["dense"], features["categorical"], labels

    def element(k):
        dense, ids, labels = tf.numpy_function(read, [k], [tf.float32, tf.int32, tf.float32],
                                               stateful=False)
        dense.set_shape([local, CRITEO_DENSE_FEATURES])
        ids.set_shape([local, len(columns.rows)])
        labels.set_shape([local, 1])
        return {"dense": dense, "categorical": ids}, labels

    # a range of step numbers: skip(k) (a resumed run) reads nothing it skips
    return tf.data.Dataset.range(count).map(element).prefetch(2)


# --------------------------------------------------------------------------- movielens

def default_data_root() -> str:
    """$TFHYBRID_DATA_DIR, else ~/.cache/tfhybrid/data."""
    return os.environ.get("TFHYBRID_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tfhybrid", "data")


def fetch_movielens(data_dir: str | None = None) -> str:
    """Makes sure ``data_dir`` holds MovieLens-100k's recbole files; returns that folder.

    The files (``ml-100k.inter``, ``.user``, ``.item``) come from the ``recbole==1.2.1``
    wheel on PyPI, downloaded with this interpreter's pip. ``data_dir`` defaults to
    ``<default_data_root()>/ml-100k``. Idempotent (nothing is downloaded when the files are
    there) and atomic (files are extracted to a temporary folder, then renamed into place),
    so concurrent ranks may all call it. A failed download raises ``RuntimeError`` with
    pip's output.
    """
    target = os.path.abspath(os.path.expanduser(
        data_dir if data_dir is not None else os.path.join(default_data_root(), "ml-100k")))
    if _has_movielens(target):
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".ml-100k-", dir=parent)
    try:
        command = [sys.executable, "-m", "pip", "download", _RECBOLE_WHEEL, "--no-deps",
                   "--disable-pip-version-check", "-q", "-d", work]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = [n for n in os.listdir(work) if n.endswith(".whl")]
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"fetching MovieLens-100k failed: {' '.join(command)} exited "
                               f"{done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
        staged = os.path.join(work, "ml-100k")
        os.mkdir(staged)
        with zipfile.ZipFile(os.path.join(work, wheels[0])) as wheel:
            for name in _MOVIELENS_FILES:
                with wheel.open(_RECBOLE_MEMBER_DIR + name) as src, \
                        open(os.path.join(staged, name), "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if not os.path.exists(target):
            try:
                os.rename(staged, target)
            except OSError:
                if not _has_movielens(target):   # not just another process winning the race
                    raise
        if not _has_movielens(target):           # an existing, incomplete folder
            for name in _MOVIELENS_FILES:
                if os.path.exists(os.path.join(staged, name)):
                    os.replace(os.path.join(staged, name), os.path.join(target, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _has_movielens(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, n)) for n in _MOVIELENS_FILES)


def _read_atomic(path: str, columns: Sequence[str]) -> list[list[str]]:
    """Reads a recbole atomic file (header ``name:type`` fields); returns the named columns."""
    with open(path, encoding="utf-8") as f:
        header = [h.split(":")[0] for h in f.readline().rstrip("\n").split("\t")]
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(f"{path}: no column(s) {missing} in header {header}")
        index = [header.index(c) for c in columns]
        out = []
        for number, line in enumerate(f, 2):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != len(header):
                raise ValueError(f"{path}, line {number}: expected {len(header)} fields, "
                                 f"got {len(fields)}")
            out.append([fields[i] for i in index])
    return out


def _contiguous(tokens: Sequence, key: Callable | None = None) -> tuple[dict, int]:
    """Maps the distinct tokens, sorted, to ids 0, 1, ...; returns (mapping, count)."""
    vocab = sorted(set(tokens), key=key)
    return {t: i for i, t in enumerate(vocab)}, len(vocab)


@dataclasses.dataclass
class _MovieLens:
    dense: np.ndarray          # float32 [n, 20], in split order: eval rows first
    ids: np.ndarray            # int64 [n, 7]
    labels: np.ndarray         # float32 [n, 1]
    n_eval: int
    table_rows: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def _movielens(folder: str, seed: int) -> _MovieLens:
    inter = _read_atomic(os.path.join(folder, "ml-100k.inter"), ["user_id", "item_id", "rating"])
    users = _read_atomic(os.path.join(folder, "ml-100k.user"),
                         ["user_id", "age", "gender", "occupation", "zip_code"])
    items = _read_atomic(os.path.join(folder, "ml-100k.item"),
                         ["item_id", "release_year", "class"])
    numeric = lambda t: (0, int(t), "") if t.isdigit() else (1, 0, t)  # noqa: E731
    user_ids, n_users = _contiguous([u[0] for u in users], numeric)
    item_ids, n_items = _contiguous([i[0] for i in items], numeric)
    genders, n_genders = _contiguous([u[2] for u in users])
    jobs, n_jobs = _contiguous([u[3] for u in users])
    zip_prefix = lambda z: z[:1] if z[:1].isdigit() else "other"  # noqa: E731
    zips, n_zips = _contiguous([zip_prefix(u[4]) for u in users])
    decade = lambda y: int(y) // 10 * 10 if y.isdigit() else -1  # noqa: E731
    decades, n_decades = _contiguous([decade(i[1]) for i in items] + [-1])   # -1 (unknown) = 0
    ages = np.array([float(u[1]) for u in users])
    age_mean, age_std = ages.mean(), ages.std()
    user_features = {u[0]: (user_ids[u[0]], genders[u[2]], jobs[u[3]], zips[zip_prefix(u[4])],
                            int(np.searchsorted(_AGE_BOUNDS, float(u[1]), side="right")),
                            (float(u[1]) - age_mean) / age_std) for u in users}
    genre_index = {g: i for i, g in enumerate(MOVIELENS_GENRES)}
    item_features = {}
    for item, year, genres in items:
        flags = np.zeros(len(MOVIELENS_GENRES), np.float32)
        for g in genres.split():
            if g not in genre_index:
                raise ValueError(f"{folder}/ml-100k.item: item {item} has genre {g!r}; "
                                 f"expected one of {MOVIELENS_GENRES}")
            flags[genre_index[g]] = 1.0
        item_features[item] = (item_ids[item], decades[decade(year)], flags)
    n = len(inter)
    dense = np.zeros([n, 1 + len(MOVIELENS_GENRES)], np.float32)
    ids = np.zeros([n, len(MOVIELENS_FEATURE_NAMES)], np.int64)
    labels = np.zeros([n, 1], np.float32)
    for row, (user, item, rating) in enumerate(inter):
        uid, gender, job, zip_id, age_bucket, age = user_features[user]
        iid, decade_id, flags = item_features[item]
        ids[row] = (uid, iid, gender, job, zip_id, age_bucket, decade_id)
        dense[row, 0] = age
        dense[row, 1:] = flags
        labels[row, 0] = float(rating) >= 4.0
    order = np.random.default_rng(seed).permutation(n)
    rows = (n_users, n_items, n_genders, n_jobs, n_zips, len(_AGE_BOUNDS) + 1, n_decades)
    return _MovieLens(dense[order], ids[order], labels[order],
                      int(n * MOVIELENS_EVAL_FRACTION), rows)


def _movielens_dataset(folder: str, split: str, global_batch: int, rank: int, local: int,
                       max_table_rows: int | None, seed: int, num_batches: int | None,
                       raw: tuple[int, ...] = ()) -> tf.data.Dataset:
    ml = _movielens(folder, seed)
    part = slice(0, ml.n_eval) if split == "eval" else slice(ml.n_eval, None)
    rows = np.array(_capped(ml.table_rows, max_table_rows), np.int64)
    dense, ids, labels = ml.dense[part], ml.ids[part] % rows, ml.labels[part]
    # raw keys: the contiguous ids themselves, never capped
    ids[:, list(raw)] = ml.ids[part][:, list(raw)]
    batches = len(labels) // global_batch
    if batches == 0:
        raise ValueError(f"movielens {split} has {len(labels)} examples, fewer than "
                         f"global_batch_size={global_batch}")
    # [batches, size, local, ...] -> this rank's [batches, local, ...]
    mine = lambda x: x[:batches * global_batch].reshape(  # noqa: E731
        batches, global_batch // local, local, *x.shape[1:])[:, rank]
    dataset = tf.data.Dataset.from_tensor_slices(
        ({"dense": mine(dense), "categorical": mine(ids).astype(np.int64 if raw else np.int32)},
         mine(labels)))
    if num_batches is not None:
        dataset = (dataset.repeat() if split == "train" else dataset).take(num_batches)
    return dataset.prefetch(2)


# --------------------------------------------------------------------------- command line

def main(argv: Sequence[str] | None = None) -> int:
    """``--fetch movielens [--data_dir DIR]``: downloads the data set, prints its folder."""
    parser = argparse.ArgumentParser(description="Fetches tfhybrid's training data sets.")
    parser.add_argument("--fetch", choices=["movielens"], required=True,
                        help="data set to download (synthetic needs none; Criteo is not "
                             "downloadable)")
    parser.add_argument("--data_dir", default=None,
                        help="folder for the files (default: $TFHYBRID_DATA_DIR/ml-100k or "
                             "~/.cache/tfhybrid/data/ml-100k)")
    args = parser.parse_args(argv)
    print(fetch_movielens(args.data_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
