"""The criteo_binary format: preprocessing, the sharded reader, and every error naming its
file. The reader must give each rank exactly what criteo_tsv gives it from the TSV the
binary came from (same samples, same order, same ids)."""

import dataclasses
import gzip
import json
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from tfhybrid.train import criteo_binary
from tfhybrid.train import data
from tfhybrid.train.preprocess import main as preprocess_main
from tfhybrid.train.preprocess import preprocess

ROWS = dict(max_table_rows=1000, cardinality_scale=1.0)


def _line(rng, hex_digits=8):
    ints = [str(int(rng.integers(-3, 5000))) if rng.random() > 0.2 else "" for _ in range(13)]
    hexes = ["" if rng.random() < 0.15 else
             format(int(rng.integers(0, 40)), f"0{hex_digits}x")   # repeats: a vocabulary
             for _ in range(26)]
    return "\t".join([str(int(rng.integers(0, 2)))] + ints + hexes)


class CriteoBinaryTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="tfhybrid-binary-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        rng = np.random.default_rng(3)
        self.tsv = os.path.join(self.dir, "tsv")
        self.train_lines = [_line(rng) for _ in range(100)]
        self.eval_lines = [_line(rng) for _ in range(40)]
        self._write("train/day_0", self.train_lines[:37])
        self._write("train/day_1.gz", self.train_lines[37:70] + ["1\tbad line"])
        self._write("train/day_2", self.train_lines[70:])
        self._write("eval/day_3", self.eval_lines)
        self.out = os.path.join(self.dir, "binary")

    def _write(self, name, lines):
        path = os.path.join(self.tsv, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        text = "".join(line + "\n" for line in lines).encode()
        with (gzip.open(path, "wb") if name.endswith(".gz") else open(path, "wb")) as f:
            f.write(text)

    def _batches(self, name, split, rank, size, batch=8, data_dir=None, skip=0, **kwargs):
        dataset = data.make_dataset(name, split, global_batch_size=batch, rank=rank,
                                    size=size, data_dir=data_dir or (
                                        self.out if name == "criteo_binary" else self.tsv),
                                    **dict(ROWS, **kwargs))
        return [(f["dense"].numpy(), f["categorical"].numpy(), y.numpy())
                for f, y in dataset.skip(skip)]

    def test_hashed_binary_reads_what_the_tsv_reader_gives_every_rank(self):
        results = preprocess(self.tsv, self.out, workers=2, skip_malformed=True,
                             log=lambda _: None)
        self.assertEqual(results["train"]["samples"], 100)
        self.assertEqual(results["train"]["malformed"], 1)
        self.assertIn("day_1.gz, line 34", results["train"]["first_malformed"])
        self.assertEqual(data.dataset_spec("criteo_binary", data_dir=self.out, **ROWS),
                         dataclasses.replace(data.dataset_spec("criteo_tsv",
                                                               data_dir=self.tsv, **ROWS),
                                             name="criteo_binary"))
        for split in ("train", "eval"):
            for size in (1, 2, 4):
                for rank in range(size):
                    want = self._batches("criteo_tsv", split, rank, size, skip_malformed=True)
                    got = self._batches("criteo_binary", split, rank, size)
                    self.assertLen(got, len(want))
                    self.assertGreater(len(got), 0)
                    for g, w in zip(got, want):
                        for a, b in zip(g, w):
                            self.assertAllEqual(a, b)
        # a resumed run reads from its step on; train repeats with num_batches
        self.assertAllEqual(self._batches("criteo_binary", "train", 1, 2, skip=5)[0][1],
                            self._batches("criteo_tsv", "train", 1, 2, skip=5,
                                          skip_malformed=True)[0][1])
        repeated = self._batches("criteo_binary", "train", 0, 1, num_batches=30)
        self.assertLen(repeated, 30)
        self.assertAllEqual(repeated[12][1], repeated[0][1])   # 12 batches per pass

    def test_vocabulary_ids(self):
        preprocess(self.tsv, self.out, ids="vocab", min_count=3, workers=1,
                   skip_malformed=True, log=lambda _: None)
        header = criteo_binary.read_header(os.path.join(self.out, "train"), 13, 26)
        fields = [line.split("\t")[14:] for line in self.train_lines]
        for t in (0, 7, 25):
            values = [int(f[t], 16) if f[t] else 0 for f in fields]
            kept = sorted(v for v in set(values) if values.count(v) >= 3)
            self.assertEqual(header["vocab_sizes"][t], len(kept) + 1)
            got = self._batches("criteo_binary", "train", 0, 1, batch=100)[0][1][:, t]
            self.assertAllEqual(got, [kept.index(v) + 1 if v in kept else 0 for v in values])
            eval_values = [int(line.split("\t")[14 + t] or "0", 16) for line in self.eval_lines]
            got = self._batches("criteo_binary", "eval", 0, 1, batch=40)[0][1][:, t]
            self.assertAllEqual(got, [kept.index(v) + 1 if v in kept else 0
                                      for v in eval_values])
        spec = data.dataset_spec("criteo_binary", data_dir=self.out, max_table_rows=None)
        self.assertEqual(spec.table_rows, tuple(header["vocab_sizes"]))
        self.assertEqual({type(r) for r in spec.table_rows}, {int})

    def test_every_error_names_the_file(self):
        with self.assertRaisesRegex(ValueError, "day_1.gz, line 34: expected 40"):
            preprocess(self.tsv, self.out, workers=1, log=lambda _: None)
        self.assertEqual(preprocess_main(["--data_dir", self.tsv, "--output_dir", self.out,
                                          "--workers", "1"]), 2)
        preprocess(self.tsv, self.out, workers=1, skip_malformed=True, log=lambda _: None)
        train = os.path.join(self.out, "train")

        def read():
            return data.make_dataset("criteo_binary", "train", global_batch_size=8,
                                     data_dir=self.out, **ROWS)

        def edit_header(**changes):
            path = os.path.join(train, criteo_binary.HEADER)
            with open(path) as f:
                header = json.load(f)
            original = dict(header)
            header.update(changes)
            with open(path, "w") as f:
                json.dump(header, f)
            return lambda: criteo_binary.write_header(train, original)

        dense = os.path.join(train, criteo_binary.DENSE_FILE)
        shutil.copy(dense, dense + ".bak")
        with open(dense, "r+b") as f:
            f.truncate(os.path.getsize(dense) - 4)
        with self.assertRaisesRegex(ValueError, r"dense.bin holds 5196 bytes; the header .*"
                                                r"header.json says 100 samples.*\(truncated\)"):
            read()
        os.replace(dense + ".bak", dense)
        restore = edit_header(dense_features=12)
        with self.assertRaisesRegex(ValueError, r"header.json has dense_features=12; the "
                                                "model expects 13"):
            read()
        restore()
        restore = edit_header(format="parquet")
        with self.assertRaisesRegex(ValueError, r"header.json is not a tfhybrid-criteo-binary"):
            read()
        restore()
        restore = edit_header(ids="vocab", vocab_sizes=[5] * 25)
        with self.assertRaisesRegex(ValueError, r"header.json has vocab_sizes for 25 features;"
                                                " expected 26"):
            read()
        restore()
        labels = os.path.join(train, criteo_binary.LABEL_FILE)
        os.replace(labels, labels + ".gone")
        with self.assertRaisesRegex(ValueError, r"cannot read .*label.bin"):
            read()
        os.replace(labels + ".gone", labels)
        with open(os.path.join(train, criteo_binary.HEADER), "w") as f:
            f.write("{not json")
        with self.assertRaisesRegex(ValueError, r"cannot read the header .*header.json"):
            read()
        with self.assertRaisesRegex(ValueError, "criteo_binary needs data_dir"):
            data.make_dataset("criteo_binary", "train", global_batch_size=8,
                              data_dir=os.path.join(self.dir, "missing"), **ROWS)
        # ids wider than a uint64 cannot be hashed exactly
        self._write("train/day_2", [_line(np.random.default_rng(0), hex_digits=17)])
        with self.assertRaisesRegex(ValueError, "day_2: a categorical field has 17 hex digits"):
            preprocess(self.tsv, self.out, workers=1, skip_malformed=True, log=lambda _: None)
