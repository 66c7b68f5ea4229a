"""The ``criteo_binary`` format: Criteo click logs preprocessed once into fixed-width
columns, read by each rank as large sequential slices (no per-line Python).

A split is a folder (``<data_dir>/train``, ``<data_dir>/eval``) holding:

* ``header.json``: ``{"format": "tfhybrid-criteo-binary", "version": 1, "samples": N,
  "dense_features": 13, "categorical_features": 26, "ids": "hash" | "vocab",
  "vocab_sizes": [...] (vocab only: rows of each table, the OOV row 0 included),
  "min_count": k (vocab only), "malformed": m, "first_malformed": "...", "sources":
  [...]}``;
* ``label.bin``: uint8 ``[N]`` (0/1);
* ``dense.bin``: float32 ``[N, 13]``, already ``log(1 + max(x, 0))`` (empty = 0);
* ``categorical.bin``: ``[N, 26]`` little-endian, uint64 raw values ``int(hex, 16)``
  (``"hash"``: the reader takes them modulo the table rows, exactly as ``criteo_tsv``
  does) or int32 vocabulary indices (``"vocab"``: values seen fewer than ``min_count``
  times in train share index 0, as DLRM's and MLPerf's preprocessing do).

The reader memory-maps the three files; rank r of N reads, for global batch k, the
rows ``[k B + r b, k B + (r + 1) b)`` (B global, b = B / N local): the same samples, in
the same order, as ``criteo_tsv`` gives that rank from the TSV the folder came from.
Global batch k is computed from k alone, so a run resumed at step k reads from there.
Every problem (a missing or unreadable file, a header of another format or feature
count, vocabulary sizes that do not match the features, a file whose size is not what
the header says) raises ``ValueError`` naming the file. ``tfhybrid.train.preprocess``
writes the format.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

FORMAT = "tfhybrid-criteo-binary"
VERSION = 1
HEADER = "header.json"
ID_MODES = ("hash", "vocab")
# column -> (file name, numpy dtype by id mode); categorical widths come from the header
ID_DTYPES = {"hash": np.dtype("<u8"), "vocab": np.dtype("<i4")}
LABEL_FILE, DENSE_FILE, CATEGORICAL_FILE = "label.bin", "dense.bin", "categorical.bin"
LABEL_DTYPE, DENSE_DTYPE = np.dtype("u1"), np.dtype("<f4")


def columns(header: dict) -> list[tuple[str, np.dtype, int]]:
    """(file name, dtype, values per sample) of a split's three files."""
    return [(LABEL_FILE, LABEL_DTYPE, 1),
            (DENSE_FILE, DENSE_DTYPE, int(header["dense_features"])),
            (CATEGORICAL_FILE, ID_DTYPES[header["ids"]], int(header["categorical_features"]))]


def write_header(folder: str, header: dict) -> None:
    with open(os.path.join(folder, HEADER), "w") as f:
        json.dump(dict(header, format=FORMAT, version=VERSION), f, indent=1)


def read_header(folder: str, dense_features: int, categorical_features: int) -> dict:
    """The split's header, checked against the files beside it and the features the
    model expects; ValueError naming the file otherwise."""
    path = os.path.join(folder, HEADER)
    try:
        with open(path) as f:
            header = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"criteo_binary: cannot read the header {path}: {error}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get(
            "version") != VERSION:
        raise ValueError(f"criteo_binary: {path} is not a {FORMAT} version {VERSION} header "
                         f"(format={header.get('format') if isinstance(header, dict) else None!r})")
    expected = {"dense_features": dense_features, "categorical_features": categorical_features}
    for key, want in expected.items():
        if header.get(key) != want:
            raise ValueError(f"criteo_binary: {path} has {key}={header.get(key)!r}; the model "
                             f"expects {want}")
    if header.get("ids") not in ID_MODES:
        raise ValueError(f"criteo_binary: {path} has ids={header.get('ids')!r}; expected one "
                         f"of {ID_MODES}")
    samples = header.get("samples")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"criteo_binary: {path} has samples={samples!r}; expected an "
                         "integer >= 0")
    if header["ids"] == "vocab":
        sizes = header.get("vocab_sizes")
        if (not isinstance(sizes, list) or len(sizes) != categorical_features
                or not all(isinstance(s, int) and s >= 1 for s in sizes)):
            raise ValueError(f"criteo_binary: {path} has vocab_sizes for "
                             f"{len(sizes) if isinstance(sizes, list) else sizes!r} features; "
                             f"expected {categorical_features} positive integers")
    for name, dtype, width in columns(header):
        file = os.path.join(folder, name)
        try:
            size = os.stat(file).st_size
            with open(file, "rb"):
                pass
        except OSError as error:
            raise ValueError(f"criteo_binary: cannot read {file}: {error}") from None
        want = samples * width * dtype.itemsize
        if size != want:
            raise ValueError(f"criteo_binary: {file} holds {size} bytes; the header "
                             f"{path} says {samples} samples x {width} x {dtype.itemsize} "
                             f"bytes = {want}" + (" (truncated)" if size < want else ""))
    return header


def table_rows(header: dict, hashed_rows: Sequence[int], max_table_rows: int | None
               ) -> tuple[int, ...]:
    """Rows of each table: the vocabulary's (capped), or for hashed ids ``hashed_rows``."""
    if header["ids"] == "hash":
        return tuple(int(r) for r in hashed_rows)
    return tuple(min(int(s), int(max_table_rows)) if max_table_rows else int(s)
                 for s in header["vocab_sizes"])


class Split:
    """One split's columns, memory-mapped: ``batch(start, count)`` reads samples
    ``[start, start + count)`` as the model's inputs (ids reduced modulo ``rows``)."""

    def __init__(self, folder: str, header: dict, rows: Sequence[int]):
        self.folder, self.header = folder, header
        self.samples = int(header["samples"])
        self.rows = np.asarray(rows, np.int64)
        self._maps = []
        for name, dtype, width in columns(header):
            if self.samples == 0:
                self._maps.append(np.zeros([0, width], dtype))
                continue
            self._maps.append(np.memmap(os.path.join(folder, name), dtype=dtype, mode="r",
                                        shape=(self.samples, width)))
        self._unsigned = header["ids"] == "hash"

    def batch(self, start: int, count: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        label, dense, categorical = (m[start:start + count] for m in self._maps)
        ids = categorical % (self.rows.astype(np.uint64) if self._unsigned else self.rows)
        return ({"dense": np.array(dense, np.float32), "categorical": ids.astype(np.int32)},
                label.astype(np.float32).reshape(count, 1))


def open_split(data_dir: Any, split: str, dense_features: int, categorical_features: int,
               hashed_rows: Sequence[int], max_table_rows: int | None) -> Split:
    if data_dir is None or not os.path.isdir(str(data_dir)):
        raise ValueError(f"criteo_binary needs data_dir=<folder with train/ and eval/ from "
                         f"python -m tfhybrid.train.preprocess>, got data_dir={data_dir!r}")
    folder = os.path.join(str(data_dir), split)
    header = read_header(folder, dense_features, categorical_features)
    return Split(folder, header, table_rows(header, hashed_rows, max_table_rows))
