"""The training app with dynamic tables: `python -m tfhybrid.train --dynamic_tables=...`.

Runs the CLI as a user would with DLRM on the open-world synthetic stream (one process,
and `horovodrun -np 4` with `--model_parallel=2`: the runs must agree, table counters
included), restores the 2x2 run's checkpoint in one process, trains DCN-v2 on raw Criteo
hex ids from a small generated TSV, and checks that bad flag values are named. The data
and the flags' checks are also tested in this process. The runs are tiny (16 steps of a
small DLRM) so the module stays near a minute per Keras.
"""

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from tests.runner import TEST_ENV
import tfhybrid
from tfhybrid.train import data
from tfhybrid.train import dynamic_tables

KERAS_MAJOR = tfhybrid.keras_major()

# it starts a 4-rank job of the app: tests/runner.py runs it beside one-process modules
STARTS_JOBS = True
FILLS_CORES = True
KERAS = (2, 3)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")

STEPS = 16
# four dynamic tables beside 22 fixed ones; capacity enough that nothing is evicted for
# lack of room (eviction decisions are per shard, so only then do 1x1 and 2x2 agree), a
# key admitted at its second sighting, and rows unseen for 6 steps expire
DYNAMIC = ["--dynamic_tables=0,C2,C10,C21", "--dynamic_capacity=20000",
           "--dynamic_admit_after=2", "--dynamic_ttl_steps=6", "--dynamic_stats_every=4"]
OPEN_FLAGS = ["--model=dlrm", "--dataset=synthetic_open", f"--steps={STEPS}",
              "--batch_size=512", "--eval_batches=8", "--embedding_dim=8",
              "--bottom_mlp_dims=32,8", "--top_mlp_dims=32,16,1", "--learning_rate=0.3",
              "--max_table_rows=20000", "--warmup_steps=2",
              # a short key lifetime: keys turn over within the run
              "--open_key_lifetime=4096",
              "--embedding_optimizer=rowwise_adagrad", "--embedding_learning_rate=0.1"]
CRITEO_TRAIN_LINES, CRITEO_EVAL_LINES, CRITEO_BATCH = 1024, 256, 256
CRITEO_C1_CAPACITY = 16

# Under Keras 3 (the suite's second run) the jobs that hold no Keras-specific code are
# left out: the Keras 2 run holds them. The runs that train, save and restore run in both.
KERAS_2_ONLY = {
    "criteo": "the input formats hold no Keras",
    "bad_features": "flag checks run before any Keras",
    "bad_optimizer": "flag checks run before any Keras",
}


def _cli(flags, np_=1, timeout=300):
    env = dict(os.environ, **TEST_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    command = [PYTHON, "-m", "tfhybrid.train"] + flags
    if np_ > 1:
        command = [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                   "--start-timeout", "60"] + command
    started = time.time()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        done = subprocess.CompletedProcess(command, -9, str(e.stdout or ""),
                                           f"{e.stderr or ''}\nkilled after {timeout} s")
    # where the module's time goes (the runner's log keeps it): no assertion on it
    print(f"app job np={np_} {flags[-1]}: {time.time() - started:.1f} s", flush=True)
    return done


def _left_out(run: str) -> bool:
    return KERAS_MAJOR == 3 and run in KERAS_2_ONLY


def _hex_line(rng, pools):
    """A Criteo line whose categorical field t is empty (15%) or a value of pools[t]."""
    ints = [str(int(rng.integers(0, 100))) for _ in range(13)]
    hexes = ["" if rng.random() < 0.15 else format(int(rng.choice(pool)), "08x")
             for pool in pools]
    return "\t".join([str(int(rng.integers(0, 2)))] + ints + hexes)


def _write_criteo(folder):
    """A tiny criteo_tsv folder; returns the train lines' hex fields [lines][26]."""
    rng = np.random.default_rng(7)
    # 32-bit values, many above 2**31 (a sign flip would show), 5 to 300 per column
    pools = [rng.integers(0, 2**32, int(rng.integers(5, 300))) for _ in range(26)]
    fields = []
    for split, count in (("train", CRITEO_TRAIN_LINES), ("eval", CRITEO_EVAL_LINES)):
        os.makedirs(os.path.join(folder, split))
        lines = [_hex_line(rng, pools) for _ in range(count)]
        with open(os.path.join(folder, split, "day_0"), "w") as f:
            f.writelines(line + "\n" for line in lines)
        if split == "train":
            fields = [line.split("\t")[14:] for line in lines]
    return fields


class DynamicAppTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = work = tempfile.mkdtemp(prefix="tfhybrid-dynamic-app-")
        cls.criteo_fields = _write_criteo(os.path.join(work, "criteo"))
        capacities = [CRITEO_C1_CAPACITY] + [4096] * 25
        first = {
            "one": OPEN_FLAGS + DYNAMIC + [f"--metrics_json={work}/one.json"],
            # DCN-v2 here, DLRM on synthetic_open: both models take raw keys
            "criteo": ["--model=dcnv2", "--dataset=criteo_tsv", f"--data_dir={work}/criteo",
                       f"--batch_size={CRITEO_BATCH}", "--embedding_dim=8",
                       "--num_cross_layers=2", "--top_mlp_dims=16,1", "--warmup_steps=0",
                       "--optimizer=rowwise_adagrad", "--dynamic_tables=all",
                       f"--dynamic_capacity={','.join(str(c) for c in capacities)}",
                       f"--metrics_json={work}/criteo.json"],
            "bad_features": ["--dynamic_tables=C1,C99"],
            "bad_optimizer": ["--dynamic_tables=all", "--optimizer=adam"],
        }
        # one-process jobs run two at a time: each has one thread (TEST_ENV)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(_cli, flags) for name, flags in first.items()
                       if not _left_out(name)}
            cls.jobs = {name: future.result() for name, future in futures.items()}
        # four ranks fill the cores alone
        cls.jobs["mesh"] = _cli(OPEN_FLAGS + DYNAMIC + [
            "--model_parallel=2", f"--checkpoint_dir={work}/mesh_ckpt",
            f"--metrics_json={work}/mesh.json"], np_=4)
        # --steps=0: restore the 2x2 checkpoint in one process and only evaluate
        cls.jobs["restored"] = _cli(
            [f for f in OPEN_FLAGS if not f.startswith("--steps")] + DYNAMIC[:-1] + [
                "--steps=0", "--restore", f"--checkpoint_dir={work}/mesh_ckpt",
                f"--metrics_json={work}/restored.json"])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)
        super().tearDownClass()

    def _run(self, name):
        if _left_out(name):
            self.skipTest(f"Keras 3 run: {KERAS_2_ONLY[name]}; the Keras 2 run holds it")
        done = self.jobs[name]
        # the first rank to fail says why; the others' tracebacks (Horovod shut down)
        # fill the tail
        causes = [line for line in done.stderr.splitlines() if "shut down" not in line
                  and ("Error" in line or "tfhybrid.train:" in line)]
        self.assertEqual(done.returncode, 0, f"the {name} run failed:\n{done.stdout[-3000:]}"
                                             f"\n{done.stderr[-5000:]}\nerrors:\n"
                                             + "\n".join(causes[:40]))
        with open(os.path.join(self.work, f"{name}.json")) as f:
            return json.load(f), done.stdout

    def test_one_process_and_2x2_train_alike_with_dynamic_tables(self):
        one, one_out = self._run("one")
        mesh, mesh_out = self._run("mesh")
        self.assertEqual(one["mesh"], [1, 1])
        self.assertEqual(mesh["mesh"], [2, 2])
        self.assertEqual(one["keras"], KERAS_MAJOR)
        print(f"AUC after {STEPS} steps: 1 process {one['auc']:.6f}, 2x2 {mesh['auc']:.6f}, "
              f"teacher {one['best_auc']:.4f}; {one['dynamic_tables']['totals']}")
        # the same keys reach the same shards' decisions: every counter equal
        self.assertEqual(one["dynamic_tables"]["tables"], mesh["dynamic_tables"]["tables"])
        self.assertAllClose(one["auc"], mesh["auc"], atol=1e-4)
        self.assertAllClose(one["train_loss"], mesh["train_loss"], atol=1e-4)
        # it learned (chance is 0.5), and the teacher of the eval that follows training
        # bounds it
        self.assertGreater(one["auc"], 0.58)
        self.assertLess(one["auc"], one["best_auc"] + 0.01)
        # the flags reached the tables: 4 of them, by feature name
        tables = one["dynamic_tables"]
        self.assertEqual(tables["features"], ["C1", "C2", "C10", "C21"])
        self.assertEqual(tables["options"]["C10"], dict(capacity=20000, admit_after=2,
                                                        evict="lfu", ttl_steps=6))
        c1 = tables["tables"]["C1"]
        # admit_after=2: keys seen once wait as candidates; ttl: the cold keys expired
        self.assertGreater(c1["candidates"], 0)
        self.assertGreater(c1["evictions"], 0)
        self.assertEqual(c1["admissions"] - c1["evictions"], c1["size"])
        self.assertEqual(c1["capacity"], 20000)
        # --dynamic_stats_every=4: four points, growing admissions
        history = tables["history"]
        self.assertEqual([point["batch"] for point in history], [4, 8, 12, 16])
        admitted = [point["admissions"] for point in history]
        self.assertEqual(admitted, sorted(admitted))
        for stdout in (one_out, mesh_out):
            self.assertIn("dynamic tables (4): ", stdout)
            self.assertIn("4 dynamic tables", stdout)
        self.assertEqual(mesh_out.count("dynamic tables (4): "), 1)   # rank 0 only

    def test_a_2x2_checkpoint_restores_dynamic_tables_in_one_process(self):
        mesh, _ = self._run("mesh")
        restored, _ = self._run("restored")
        self.assertEqual(restored["steps"], STEPS)
        self.assertEqual(restored["mesh"], [1, 1])
        # eval at the same stream time, from rows restored by key onto another mesh
        self.assertAllClose(restored["auc"], mesh["auc"], atol=1e-6)
        self.assertAllClose(restored["logloss"], mesh["logloss"], atol=1e-6)
        self.assertEqual(restored["best_auc"], mesh["best_auc"])
        for name, table in mesh["dynamic_tables"]["tables"].items():
            self.assertEqual(restored["dynamic_tables"]["tables"][name]["size"],
                             table["size"], name)

    def test_criteo_hex_ids_become_raw_keys(self):
        run, stdout = self._run("criteo")
        self.assertEqual(run["model"], "dcnv2")
        self.assertEqual(run["steps"], CRITEO_TRAIN_LINES // CRITEO_BATCH)
        self.assertIn("dynamic tables (26): ", stdout)
        tables = run["dynamic_tables"]["tables"]
        for t in range(1, 26):
            # one key per distinct 32-bit value, and one for the empty field; taken modulo
            # the table's rows (3 for C6) they would be fewer
            keys = {int(f[t], 16) if f[t] else -1 for f in self.criteo_fields}
            self.assertEqual(tables[f"C{t + 1}"]["size"], len(keys), f"C{t + 1}")
            self.assertEqual(tables[f"C{t + 1}"]["evictions"], 0)
        self.assertGreater(len({f[5] for f in self.criteo_fields}),
                           data.scaled_cardinalities(1e-3, 100_000)[5])
        c1 = tables["C1"]
        self.assertEqual(c1["size"], CRITEO_C1_CAPACITY)
        self.assertGreater(c1["evictions"] + c1["refusals"], 0)
        self.assertTrue(0.0 <= run["auc"] <= 1.0)

    def test_bad_flags_name_the_value(self):
        for name, expected in (("bad_features", ["--dynamic_tables=C1,C99", "'C99'"]),
                               ("bad_optimizer", ["--optimizer='adam'",
                                                  "--embedding_optimizer"])):
            if _left_out(name):
                self.skipTest(f"Keras 3 run: {KERAS_2_ONLY[name]}")
            done = self.jobs[name]
            self.assertNotEqual(done.returncode, 0, name)
            for text in expected:
                self.assertIn(text, done.stderr, name)


def _config(**values):
    from tfhybrid.train.app import TrainConfig
    return TrainConfig(**values)


class DynamicFlagsTest(tf.test.TestCase):

    def test_validate_names_the_flag_and_value(self):
        dynamic = dict(dynamic_tables=("C1", "C10"), optimizer="rowwise_adagrad")
        cases = [
            (dict(dynamic, dynamic_tables=("C99",)), "'C99' is not a feature of synthetic"),
            (dict(dynamic, dynamic_tables=("26",)), "feature index 26 is out of range"),
            (dict(dynamic, dynamic_tables=("all", "C1")), "'all' stands alone"),
            (dict(dynamic, dynamic_tables=("C1", "0")), "names feature C1 .index 0. twice"),
            (dict(dynamic, dynamic_tables=("user_id",), dataset="movielens",
                  dynamic_capacity=(0,)), r"--dynamic_capacity=0: 0 is not an integer >= 1"),
            (dict(dynamic, dynamic_capacity=(5, 6, 7)),
             "--dynamic_capacity=5,6,7 gives 3 capacities for 2 dynamic tables"),
            (dict(dynamic, dynamic_evict="fifo"), "--dynamic_evict='fifo' is unknown"),
            (dict(dynamic, dynamic_admit_after=0), "--dynamic_admit_after=0 must be"),
            (dict(dynamic, dynamic_ttl_steps=-1), "--dynamic_ttl_steps=-1 must be"),
            (dict(dynamic, optimizer="adam"), "--optimizer='adam' keeps a slot per entry"),
            (dict(dynamic, embedding_optimizer="adagrad"),
             "--embedding_optimizer='adagrad' keeps a slot"),
            (dict(dynamic, dataset="criteo_binary"), "--dataset=criteo_binary does not give"),
            (dict(dynamic, export_dir="/tmp/x"), "--export_dir=/tmp/x exclude each other"),
            (dict(dynamic, fiited_target=0.5), "--fiited_target=0.5 exclude each other"),
            (dict(dynamic_capacity=(10,)), "--dynamic_capacity set.* --dynamic_tables names "
                                           "none"),
            (dict(open_key_lifetime=100), "--open_key_lifetime=100 shapes "
                                          "--dataset=synthetic_open only"),
            (dict(dataset="synthetic_open", open_key_lifetime=0), "--open_key_lifetime=0"),
        ]
        for values, message in cases:
            with self.subTest(values=values):
                with self.assertRaisesRegex(ValueError, message):
                    _config(**values).validate()
        # good ones pass: names and indices, sgd, a string from a program
        for values in (dynamic, dict(dynamic, dynamic_tables="all", optimizer="sgd"),
                       dict(dynamic, dynamic_capacity=(5, 6), dynamic_evict="none")):
            _config(**values).validate()

    def test_docstring_examples_run(self):
        import doctest
        result = doctest.testmod(dynamic_tables)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)

    def test_table_options(self):
        config = _config(dynamic_tables=("C2", "0"), dynamic_evict="none",
                         dynamic_admit_after=3, optimizer="rowwise_adagrad")
        rows = data.scaled_cardinalities(1e-3, 100_000)
        options = dynamic_tables.table_options(config, rows)
        # by default a table has its fixed table's rows
        self.assertEqual(options, {0: dict(capacity=rows[0], admit_after=3, evict=None,
                                           ttl_steps=None),
                                   1: dict(capacity=rows[1], admit_after=3, evict=None,
                                           ttl_steps=None)})
        config = _config(dynamic_tables=("1", "0"), dynamic_capacity=(7, 9),
                         optimizer="rowwise_adagrad")
        self.assertEqual({t: o["capacity"] for t, o in
                          dynamic_tables.table_options(config, rows).items()}, {0: 7, 1: 9})

    def test_model_takes_raw_keys_and_its_config_round_trips(self):
        from tfhybrid import mesh as mesh_lib
        from tfhybrid.train.models import DLRM, example_batch
        tfhybrid.init(model_parallel=1)
        try:
            model = DLRM(table_rows=[100, 20], dense_features=3, embedding_dim=4,
                         bottom_mlp_dims=[8, 4], top_mlp_dims=[8, 1],
                         dynamic_tables={1: dict(capacity=50, evict="lru")})
            self.assertEqual(example_batch(model)["categorical"].dtype, tf.int64)
            keys = tf.constant([[3, -2**62], [7, 2**40]], tf.int64)
            logits = model({"dense": tf.ones([2, 3]), "categorical": keys}, training=True)
            self.assertEqual(logits.shape, (2, 1))
            stats = model.embedding.table_stats()["table_1"]
            self.assertEqual((stats["size"], stats["capacity"]), (2, 50))
            # a JSON round trip turns the features into strings
            config = json.loads(json.dumps(model.get_config()))
            copy = DLRM.from_config(config)
            self.assertEqual(copy.dynamic_tables, {1: dict(capacity=50, evict="lru")})
            with self.assertRaisesRegex(ValueError, r"dynamic tables \[5\] are not features"):
                DLRM(table_rows=[100, 20], dense_features=3, embedding_dim=4,
                     bottom_mlp_dims=[8, 4], dynamic_tables={5: dict(capacity=5)})
        finally:
            mesh_lib.reset()


class OpenWorldDataTest(tf.test.TestCase):

    def _global(self, size, split="train", **kwargs):
        """The categorical blocks of synthetic_open's global batches, assembled from
        ``size`` ranks' local batches."""
        per_rank = [list(data.make_dataset("synthetic_open", split, rank=rank, size=size,
                                           **kwargs).as_numpy_iterator())
                    for rank in range(size)]
        return [np.concatenate([per_rank[r][k][0]["categorical"] for r in range(size)])
                for k in range(len(per_rank[0]))]

    def test_ranks_share_global_batches_and_raw_columns_hold_keys(self):
        options = dict(global_batch_size=64, num_batches=3, raw_keys=[0, 9], seed=1)
        one, four = self._global(1, **options), self._global(4, **options)
        for a, b in zip(one, four):
            np.testing.assert_array_equal(a, b)
        ids = np.concatenate(one)
        self.assertEqual(ids.dtype, np.int64)
        rows = np.array(data.scaled_cardinalities(1e-3))
        # raw keys span 64 bits, any sign; the other columns are row ids
        self.assertTrue((ids[:, 0] < 0).any() and (ids[:, 0] > 2**40).any())
        fixed = [t for t in range(26) if t not in (0, 9)]
        self.assertTrue(((ids[:, fixed] >= 0) & (ids[:, fixed] < rows[fixed])).all())
        # without raw keys a key is hashed into its rows
        plain = np.concatenate(self._global(1, global_batch_size=64, num_batches=3, seed=1))
        self.assertEqual(plain.dtype, np.int32)
        np.testing.assert_array_equal(plain[:, 0], ids[:, 0].view(np.uint64) % np.uint64(rows[0]))
        np.testing.assert_array_equal(plain[:, fixed], ids[:, fixed])
        # another seed, other keys
        other = np.concatenate(self._global(1, **dict(options, seed=2)))
        self.assertFalse(np.isin(other[:, 0], ids[:, 0]).any())

    def test_keys_turn_over_and_small_tables_keep_theirs(self):
        rows = data.scaled_cardinalities(1e-3)
        teacher = data.OpenWorldTeacher(0, rows, key_lifetime=1000)
        _, early, _, _ = teacher.generate("train", 0, 4000)
        _, late, _, _ = teacher.generate("train", 0, 4000, time_start=50_000)
        drifting = [t for t, r in enumerate(rows) if r >= data.OPEN_STABLE_BELOW]
        stable = [t for t, r in enumerate(rows) if r < data.OPEN_STABLE_BELOW]
        self.assertEqual(len(drifting), 8)
        for t in drifting:
            # 50 lifetimes later every slot holds a new key
            self.assertFalse(np.isin(late[:, t], early[:, t]).any(), t)
        for t in stable:
            self.assertEqual(set(late[:, t]), set(early[:, t]), t)
            self.assertLessEqual(len(set(early[:, t])), rows[t])
        # the distinct keys grow with the samples, by about rows / lifetime per sample
        # in the hot slots, and are counted as the stream gives them
        counts = data.open_distinct_keys(8192, seed=0, open_key_lifetime=1000)
        half = data.open_distinct_keys(4096, seed=0, open_key_lifetime=1000)
        stream = np.concatenate([b[0]["categorical"] for b in data.make_dataset(
            "synthetic_open", "train", global_batch_size=1024, num_batches=8, raw_keys=[0],
            open_key_lifetime=1000).as_numpy_iterator()])
        self.assertEqual(counts[0], len(np.unique(stream[:, 0])))
        self.assertGreater(counts[0], half[0] * 1.5)
        self.assertEqual(counts[5], half[5])   # a stable table: its 3 keys

    def test_eval_follows_training_in_stream_time(self):
        def eval_keys(start):
            batches = data.make_dataset("synthetic_open", "eval", global_batch_size=1024,
                                        num_batches=2, raw_keys=[0], eval_start=start,
                                        open_key_lifetime=1000)
            return np.concatenate([b[0]["categorical"][:, 0] for b in
                                   batches.as_numpy_iterator()])
        self.assertFalse(np.isin(eval_keys(10**6), eval_keys(0)).any())
        np.testing.assert_array_equal(eval_keys(5000), eval_keys(5000))
        best = data.best_auc("synthetic_open", eval_start=10**6, open_key_lifetime=1000)
        self.assertTrue(0.7 < best < 0.9, best)
        self.assertIsNone(data.best_auc("criteo_tsv"))

    def test_raw_key_arguments_name_the_value(self):
        with self.assertRaisesRegex(ValueError, "dataset 'criteo_binary' gives no raw keys"):
            data.make_dataset("criteo_binary", "train", global_batch_size=8, raw_keys=[0])
        with self.assertRaisesRegex(ValueError, r"\[7\] not categorical columns of "
                                                "'movielens', which has 7"):
            data.check_raw_keys("movielens", [0, 7])
        with self.assertRaisesRegex(ValueError, "eval_start=-1"):
            data.make_dataset("synthetic_open", "eval", global_batch_size=8, eval_start=-1)


class CriteoRawKeysTest(tf.test.TestCase):

    def test_hex_fields_become_their_values_and_empty_one_key(self):
        fields = np.array([[b"ff", b"", b"0"], [b"8000000A", b"00", b"fffffffffffffff"]])
        self.assertEqual(data.hex_keys(fields).tolist(),
                         [[255, data.EMPTY_FIELD_KEY, 0], [0x8000000A, 0, 2**60 - 1]])

    def test_a_raw_key_field_of_more_than_15_digits_is_malformed(self):
        folder = tempfile.mkdtemp(prefix="tfhybrid-raw-criteo-")
        self.addCleanup(shutil.rmtree, folder, True)
        long_field = "1" * 16
        line = "\t".join(["1"] + ["5"] * 13 + ["ab", long_field] + ["cd"] * 24)
        for split in ("train", "eval"):
            os.makedirs(os.path.join(folder, split))
            with open(os.path.join(folder, split, "day_0"), "w") as f:
                f.write((line + "\n") * 8)

        def first(raw_keys):
            return next(iter(data.make_dataset("criteo_tsv", "train", global_batch_size=8,
                                               data_dir=folder, raw_keys=raw_keys)))
        # C2 as a row id takes any length; as a raw key it may not exceed 15 digits
        features, _ = first([0])
        self.assertEqual(features["categorical"].dtype, tf.int64)
        self.assertEqual(int(features["categorical"][0, 0]), 0xab)
        self.assertEqual(int(features["categorical"][0, 2]),
                         0xcd % data.scaled_cardinalities(1e-3)[2])
        with self.assertRaisesRegex(Exception, f"line 1: categorical field C2 '{long_field}' "
                                               "has 16 hex digits"):
            first([1])


if __name__ == "__main__":
    tf.test.main()
