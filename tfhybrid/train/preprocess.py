"""Criteo TSV -> the ``criteo_binary`` format, once, so training reads without parsing.

Usage::

    python -m tfhybrid.train.preprocess --data_dir=TSV_DIR --output_dir=OUT \\
        [--ids=hash|vocab] [--min_count=1] [--workers=N] [--skip_malformed]

``TSV_DIR`` is laid out as ``criteo_tsv`` expects (``train/`` and ``eval/`` subfolders,
or day files whose last one is eval; plain or gzip). ``OUT/train`` and ``OUT/eval``
receive the format of :mod:`tfhybrid.train.criteo_binary`. Files are converted in
parallel (``--workers`` processes, each file by one of them, written as parts then joined
in file order, so the samples keep the TSV's order).

* ``--ids=hash`` (default) stores each categorical value as ``int(hex, 16)``; the reader
  takes it modulo the table rows, so training on the output equals training on the TSV
  with ``--dataset=criteo_tsv``.
* ``--ids=vocab`` maps each feature's values seen at least ``--min_count`` times in train
  to 1.. (ascending value), everything else (and every value eval adds) to row 0.

A malformed line stops the conversion with ``<file>, line <n>: <what>``, or with
``--skip_malformed`` is skipped, counted and reported (and recorded in the header). The
command prints lines/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from tfhybrid.train import criteo_binary
from tfhybrid.train import data

# valid lines converted at once by a worker
_CHUNK_LINES = 1 << 16
# hex digits a uint64 holds
_MAX_HEX_DIGITS = 16


@dataclasses.dataclass
class FileReport:
    path: str
    lines: int
    samples: int
    malformed: int
    first_malformed: str | None


def _convert_file(job: tuple[str, str, bool]) -> FileReport:
    """One TSV file -> parts ``<prefix>.label/.dense/.categorical`` (raw uint64 ids)."""
    path, prefix, skip_malformed = job
    stats = data.ParseStats()
    outputs = [open(f"{prefix}.{name}", "wb") for name in ("label", "dense", "categorical")]
    try:
        lines: list[list[bytes]] = []

        def flush():
            labels, dense, hex_fields = data.criteo_columns(lines)
            if hex_fields.dtype.itemsize > _MAX_HEX_DIGITS:
                longest = max(len(f) for row in lines
                              for f in row[1 + data.CRITEO_DENSE_FEATURES:])
                raise ValueError(f"{path}: a categorical field has {longest} hex digits; "
                                 f"--ids=hash stores at most {_MAX_HEX_DIGITS} (uint64)")
            outputs[0].write(labels.astype(criteo_binary.LABEL_DTYPE).tobytes())
            outputs[1].write(dense.astype(criteo_binary.DENSE_DTYPE).tobytes())
            outputs[2].write(data.hex_values(hex_fields).astype(
                criteo_binary.ID_DTYPES["hash"]).tobytes())
            lines.clear()

        for line in data.valid_criteo_lines(path, skip_malformed, stats):
            lines.append(line.split(b"\t"))
            if len(lines) == _CHUNK_LINES:
                flush()
        if lines:
            flush()
    finally:
        for f in outputs:
            f.close()
    return FileReport(path, stats.lines, stats.examples, stats.malformed,
                      stats.first_malformed)


def _join(parts: list[str], target: str) -> None:
    with open(target, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            os.remove(part)


def _vocabularies(categorical: np.ndarray, min_count: int) -> list[np.ndarray]:
    """Per feature, the ascending values seen at least ``min_count`` times."""
    vocab = []
    for t in range(categorical.shape[1]):
        values, counts = np.unique(np.asarray(categorical[:, t]), return_counts=True)
        vocab.append(values[counts >= min_count])
    return vocab


def _map_to_vocab(folder: str, samples: int, vocab: list[np.ndarray]) -> None:
    """Rewrites ``folder``'s raw ids as int32 vocabulary indices (0: out of vocabulary)."""
    path = os.path.join(folder, criteo_binary.CATEGORICAL_FILE)
    raw = np.fromfile(path, criteo_binary.ID_DTYPES["hash"]).reshape(samples, len(vocab))
    ids = np.zeros(raw.shape, criteo_binary.ID_DTYPES["vocab"])
    for t, values in enumerate(vocab):
        position = np.searchsorted(values, raw[:, t])
        found = position < len(values)
        found[found] = values[position[found]] == raw[found, t]
        ids[:, t] = np.where(found, position + 1, 0)
    ids.tofile(path)


def preprocess(data_dir: str, output_dir: str, ids: str = "hash", min_count: int = 1,
               workers: int | None = None, skip_malformed: bool = False,
               log=print) -> dict[str, dict]:
    """Converts both splits of ``data_dir``; returns each split's header plus the lines
    read and the seconds taken."""
    if ids not in criteo_binary.ID_MODES:
        raise ValueError(f"ids={ids!r} is unknown; expected one of {criteo_binary.ID_MODES}")
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"min_count={min_count!r} must be an integer >= 1")
    workers = workers or os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an integer >= 1")
    splits = {split: data.criteo_files(data_dir, split) for split in data.SPLITS}
    os.makedirs(output_dir, exist_ok=True)
    results = {}
    vocab = None
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for split in ("train", "eval"):   # the vocabulary comes from train
            start = time.perf_counter()
            folder = os.path.join(output_dir, split)
            os.makedirs(folder, exist_ok=True)
            scratch = tempfile.mkdtemp(prefix=".parts-", dir=folder)
            try:
                jobs = [(path, os.path.join(scratch, str(i)), skip_malformed)
                        for i, path in enumerate(splits[split])]
                reports = pool.map(_convert_file, jobs, chunksize=1)
                for name, file in (("label", criteo_binary.LABEL_FILE),
                                   ("dense", criteo_binary.DENSE_FILE),
                                   ("categorical", criteo_binary.CATEGORICAL_FILE)):
                    _join([f"{prefix}.{name}" for _, prefix, _ in jobs],
                          os.path.join(folder, file))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            samples = sum(r.samples for r in reports)
            n_cat = len(data.CRITEO_1TB_CARDINALITIES)
            header = {"samples": samples, "dense_features": data.CRITEO_DENSE_FEATURES,
                      "categorical_features": n_cat, "ids": ids,
                      "malformed": sum(r.malformed for r in reports),
                      "first_malformed": next((r.first_malformed for r in reports
                                               if r.first_malformed), None),
                      "sources": [os.path.abspath(r.path) for r in reports]}
            if ids == "vocab":
                if vocab is None:
                    raw = np.memmap(os.path.join(folder, criteo_binary.CATEGORICAL_FILE),
                                    criteo_binary.ID_DTYPES["hash"], "r",
                                    shape=(samples, n_cat)) if samples else np.zeros(
                                        [0, n_cat], np.uint64)
                    vocab = _vocabularies(raw, min_count)
                    del raw
                _map_to_vocab(folder, samples, vocab)
                header.update(vocab_sizes=[len(v) + 1 for v in vocab], min_count=min_count)
            criteo_binary.write_header(folder, header)
            seconds = time.perf_counter() - start
            lines = sum(r.lines for r in reports)
            results[split] = dict(header, lines=lines, seconds=seconds)
            log(f"{split}: {lines:,} lines -> {samples:,} samples in {folder} "
                f"({lines / max(seconds, 1e-9):,.0f} lines/s, {workers} workers)"
                + (f"; {header['malformed']} malformed lines skipped, the first: "
                   f"{header['first_malformed']}" if header["malformed"] else ""))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="criteo_tsv folder")
    parser.add_argument("--output_dir", required=True, help="where train/ and eval/ go")
    parser.add_argument("--ids", default="hash", choices=criteo_binary.ID_MODES)
    parser.add_argument("--min_count", type=int, default=1,
                        help="--ids=vocab: values seen fewer times in train map to row 0")
    parser.add_argument("--workers", type=int, default=None, help="default: every core")
    parser.add_argument("--skip_malformed", action="store_true",
                        help="skip malformed lines (counted and reported) instead of failing")
    args = parser.parse_args(argv)
    try:
        preprocess(args.data_dir, args.output_dir, args.ids, args.min_count, args.workers,
                   args.skip_malformed)
    except ValueError as error:
        print(f"preprocess: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
