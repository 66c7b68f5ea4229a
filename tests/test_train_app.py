"""The training app end to end: `python -m tfhybrid.train` in one process and on a 2x2 mesh.

Runs the CLI as a user would (one process, and `horovodrun -np 4` with
`--model_parallel=2`), then checks AUC parity, checkpoint restore onto a different mesh
through `--restore`, and the exported SavedModels. The runs are small (a few dozen steps
of a small DLRM on synthetic data) so the module stays within a couple of minutes.
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

KERAS_MAJOR = tfhybrid.keras_major()

# it starts multi-process jobs of its own: tests/runner.py runs it beside one-process
# modules only
STARTS_JOBS = True
# its jobs (four ranks, or two one-process runs side by side) keep both cores busy
FILLS_CORES = True
KERAS = (2, 3)

# The module starts several jobs of the app (most with 4 ranks on 2 cores): 559 s
# measured on a slow day, past the runner's default limit of 480 s.
RUN_TIMEOUT_S = 1200

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")

# N steps of the parity check, and the rest of the run's shape
PARITY_STEPS = 40
COMMON_FLAGS = ["--model=dlrm", "--dataset=synthetic", f"--steps={PARITY_STEPS}",
                "--batch_size=512", "--eval_batches=32", "--embedding_dim=8",
                "--bottom_mlp_dims=32,8", "--top_mlp_dims=32,16,1", "--learning_rate=0.5",
                "--max_table_rows=20000", "--row_slice_threshold=40000",
                "--data_parallel_threshold=200", "--warmup_steps=2",
                # tables and dense layers with their own optimizers (and checkpointed slots)
                "--embedding_optimizer=rowwise_adagrad", "--embedding_learning_rate=0.1"]


# Under Keras 3 (the suite's second run) the runs of features without Keras-specific
# code in the app are left out, each where another module runs its Keras 3 paths: the
# Keras 2 run holds them in the app. The app's own Keras branches (the --keras flag, the
# optimizers, its checkpoints and exports, the custom step) run in both.
KERAS_2_ONLY = {
    "dct": "DCT's Keras 3 path is tests/test_dct.py's",
    "tiered": "tiered tables' Keras 3 path is tests/test_tiers.py's",
    "fiited_tiered": "tiered FIITED tables' Keras 3 path is tests/test_tiers.py's",
    "fiited_one": "tiered FIITED tables' Keras 3 path is tests/test_tiers.py's",
    "binary": "the input formats hold no Keras",
}

# DRAM for a fraction of the "one" run's tables: the planner tiers the largest
DRAM_BUDGET = 1_500_000

# DCT at keep fractions that still learn in PARITY_STEPS steps, with thresholds refreshed often
DCT_FLAGS = ["--dct_dp_keep=0.05", "--dct_mp_keep=0.25", "--dct_refresh_every=10"]
# FIITED: half of the tables' chunks (of 2 floats) kept, adjusted every 10 batches
FIITED_FLAGS = ["--fiited_target=0.5", "--fiited_chunks=4", "--fiited_every=10",
                "--fiited_ramp=30"]


def _cli(flags, np_=1, timeout=420, env_changes=None):
    """Runs the app; ``env_changes`` sets variables (a value of None unsets one)."""
    env = dict(os.environ, **TEST_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for name, value in (env_changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    command = [PYTHON, "-m", "tfhybrid.train"] + flags
    if np_ > 1:
        command = [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                   "--start-timeout", "60"] + command
    started = time.time()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # a job started in setUpClass fails the test that checks it, not the whole class
        done = subprocess.CompletedProcess(command, -9, str(e.stdout or ""),
                                           f"{e.stderr or ''}\nkilled after {timeout} s")
    # where the module's time goes (the runner's log keeps it): no assertion on it
    print(f"app job np={np_} {' '.join(flags[:1] + flags[-2:])}: "
          f"{time.time() - started:.1f} s", flush=True)
    return done


def _side_by_side(jobs):
    """{name: finished job} for one-process app jobs {name: flags}, two at a time.

    Each such job runs on one thread (TEST_ENV), so two of them share the machine's two
    cores, as tests/runner.py pairs one-process modules. Jobs of several ranks do not:
    they already fill the cores.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_cli, *job) if isinstance(job, tuple)
                   else pool.submit(_cli, job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _left_out(run: str) -> bool:
    return KERAS_MAJOR == 3 and run in KERAS_2_ONLY


def _skip_if_left_out(test: tf.test.TestCase, run: str) -> None:
    if _left_out(run):
        test.skipTest(f"Keras 3 run: {KERAS_2_ONLY[run]}; the Keras 2 run holds the app's")


class TrainAppTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = tempfile.mkdtemp(prefix="tfhybrid-app-")
        work = cls.work
        # The one-process jobs run two at a time (_side_by_side), so every job is
        # started here, in the order its inputs exist; each test still checks its own
        # job's exit code and output. First the one-process jobs that need nothing:
        # the "one" run, its tiered twin, a FIITED run and its tiered twin, and the bad
        # flags.
        # "one" chooses this module's Keras by --keras, TF_USE_LEGACY_KERAS unset;
        # "keras_conflict" asks for the other Keras than TF_USE_LEGACY_KERAS does
        first = {
            "one": (COMMON_FLAGS + [f"--metrics_json={work}/one.json",
                                    f"--export_dir={work}/one_export",
                                    f"--checkpoint_dir={work}/one_ckpt",
                                    f"--keras={KERAS_MAJOR}"], 1, 420,
                    {"TF_USE_LEGACY_KERAS": None}),
            "tiered": COMMON_FLAGS + [f"--dram_budget={DRAM_BUDGET}",
                                      f"--store_dir={work}/tiered_store",
                                      f"--metrics_json={work}/tiered.json"],
            "fiited_one": COMMON_FLAGS + FIITED_FLAGS + [
                f"--metrics_json={work}/fiited_one.json"],
            "fiited_tiered": COMMON_FLAGS + FIITED_FLAGS + [
                f"--dram_budget={DRAM_BUDGET}", f"--store_dir={work}/fiited_tiered_store",
                f"--metrics_json={work}/fiited_tiered.json"],
            "bad_bottom": ["--model=dlrm", "--embedding_dim=16", "--bottom_mlp_dims=32,8"],
            "bad_top": ["--top_mlp_dims=8,x"],
            "keras_conflict": (["--keras=3"], 1, 420, {"TF_USE_LEGACY_KERAS": "1"}),
        }
        cls.jobs = _side_by_side({name: job for name, job in first.items()
                                  if not _left_out(name)})
        cls.runs = {}
        cls._keep("one")
        # the 2x2 runs, one after another (four ranks fill the cores)
        # "dct": the 2x2 run with both halves of DCT on (fit through the one gradient path)
        for name, extra in [("mesh", ["--model_parallel=2", "--count_traffic"]),
                            ("dct", ["--model_parallel=2", "--count_traffic"] + DCT_FLAGS),
                            ("fiited", ["--model_parallel=2"] + FIITED_FLAGS)]:
            if _left_out(name):
                continue
            out = os.path.join(work, name)
            # the DCT run's checkpoint and export would check nothing the others do not
            saved = [] if name == "dct" else [f"--export_dir={out}_export",
                                              f"--checkpoint_dir={out}_ckpt"]
            cls.jobs[name] = _cli(COMMON_FLAGS + extra + [f"--metrics_json={out}.json"]
                                  + saved, np_=4)
            cls._keep(name)
        # --steps=0: restore a 2x2 run's final checkpoint in one process and only evaluate
        restore = COMMON_FLAGS[:2] + ["--steps=0"] + COMMON_FLAGS[3:]
        cls.jobs.update(_side_by_side({
            "restored": restore + ["--restore", f"--checkpoint_dir={work}/mesh_ckpt",
                                   f"--metrics_json={work}/restored.json"],
            "fiited_restored": restore + FIITED_FLAGS + [
                "--restore", f"--checkpoint_dir={work}/fiited_ckpt",
                f"--metrics_json={work}/fiited_restored.json"],
        }))

    @classmethod
    def _keep(cls, name):
        """Keeps a run every test compares with: the module cannot go on without it."""
        done = cls.jobs[name]
        if done.returncode != 0:
            raise AssertionError(f"the {name} run failed:\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-5000:]}")
        with open(os.path.join(cls.work, f"{name}.json")) as f:
            cls.runs[name] = (json.load(f), done.stdout)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)
        super().tearDownClass()

    def test_auc_parity_one_process_vs_2x2(self):
        one, mesh = self.runs["one"][0], self.runs["mesh"][0]
        self.assertEqual(one["mesh"], [1, 1])
        self.assertEqual(mesh["mesh"], [2, 2])
        self.assertEqual(one["steps"], PARITY_STEPS)
        self.assertEqual(one["eval_samples"], mesh["eval_samples"])
        print(f"AUC after {PARITY_STEPS} steps: 1 process {one['auc']:.6f}, "
              f"2x2 {mesh['auc']:.6f}, teacher {one['best_auc']:.4f}")
        self.assertLessEqual(abs(one["auc"] - mesh["auc"]), 0.002)
        # it learned: well above chance, and no better than the planted teacher allows
        self.assertGreater(one["auc"], 0.6)
        self.assertLess(one["auc"], one["best_auc"] + 0.01)

    def test_dct_trains_with_less_traffic(self):
        _skip_if_left_out(self, "dct")
        mesh, dct = self.runs["mesh"][0], self.runs["dct"][0]
        self.assertIsNone(mesh["dct"])
        self.assertEqual(dct["dct"], dict(dp_keep=0.05, mp_keep=0.25, refresh_every=10))
        print(f"AUC after {PARITY_STEPS} steps on 2x2: {mesh['auc']:.4f}, with DCT "
              f"{dct['auc']:.4f}; bytes/step {mesh['collective_bytes_per_step']} -> "
              f"{dct['collective_bytes_per_step']}")
        # it learned (quality at equal steps is benchmarks/dct_quality.py's job)
        self.assertGreater(dct["auc"], 0.6)
        self.assertLessEqual(abs(dct["auc"] - mesh["auc"]), 0.05)
        before, after = mesh["collective_bytes_per_step"], dct["collective_bytes_per_step"]
        # both kinds shrink (the dense layers are a small share of this model's syncs,
        # the ids' alltoall goes untouched; tests/test_dct.py measures each half)
        self.assertLess(after["allreduce"], before["allreduce"])
        self.assertLess(after["alltoall"], before["alltoall"])

    def test_rank0_prints_auc_and_throughput(self):
        for name in ("one", "mesh"):
            stdout = self.runs[name][1]
            self.assertIn("eval: AUC", stdout)
            self.assertIn("samples/s", stdout)
            self.assertGreater(self.runs[name][0]["samples_per_second"], 0)
        # only rank 0 prints the summary
        self.assertEqual(self.runs["mesh"][1].count("eval: AUC"), 1)

    def test_exported_models_agree_across_meshes(self):
        rng = np.random.default_rng(0)
        dense = tf.constant(rng.random([64, 13]), tf.float32)
        # ids below 3: the smallest Criteo table has 3 rows
        categorical = tf.constant(rng.integers(0, 3, [64, 26]), tf.int32)
        outputs = []
        for name in ("one", "mesh"):
            loaded = tf.saved_model.load(os.path.join(self.work, f"{name}_export"))
            outputs.append(loaded.signatures["serving_default"](
                dense=dense, categorical=categorical)["probability"].numpy())
        self.assertAllClose(outputs[0], outputs[1], atol=1e-5)
        self.assertTrue(np.all((outputs[0] > 0) & (outputs[0] < 1)))

    def test_restore_2x2_checkpoint_in_one_process(self):
        # --steps=0: restore the 2x2 run's final checkpoint and only evaluate
        out = os.path.join(self.work, "restored.json")
        done = self.jobs["restored"]
        self.assertEqual(done.returncode, 0, done.stderr[-5000:])
        with open(out) as f:
            restored = json.load(f)
        self.assertEqual(restored["steps"], PARITY_STEPS)
        self.assertAllClose(restored["auc"], self.runs["mesh"][0]["auc"], atol=1e-6)
        self.assertAllClose(restored["logloss"], self.runs["mesh"][0]["logloss"], atol=1e-6)

    def test_fiited_prunes_learns_and_restores_in_one_process(self):
        mesh, fiited = self.runs["mesh"][0], self.runs["fiited"][0]
        figures = fiited["fiited"]
        print(f"AUC after {PARITY_STEPS} steps on 2x2: {mesh['auc']:.4f}, with FIITED "
              f"{fiited['auc']:.4f} at {figures['memory_saved']:.1%} less embedding memory")
        self.assertIsNone(mesh["fiited"])
        self.assertEqual(figures["chunks"], 4)
        # half the 4 chunks of every row are kept (8 bytes each), plus the 4-byte row
        # offsets (rows + 1 per table, 26 tables)
        rows = figures["dense_bytes"] // (4 * 8)
        self.assertEqual(figures["chunks_kept"], rows * 2)
        self.assertEqual(figures["embedding_bytes"],
                         figures["chunks_kept"] * 8 + 4 * (rows + 26))
        self.assertGreater(figures["memory_saved"], 0.3)
        self.assertGreater(fiited["auc"], 0.6)
        # the 2x2 checkpoint (pools, layouts, utilities) restores in one process
        out = os.path.join(self.work, "fiited_restored.json")
        done = self.jobs["fiited_restored"]
        self.assertEqual(done.returncode, 0, done.stderr[-5000:])
        with open(out) as f:
            restored = json.load(f)
        self.assertEqual(restored["fiited"]["chunks_kept"], figures["chunks_kept"])
        self.assertAllClose(restored["auc"], fiited["auc"], atol=1e-6)
        # the exported model (dense tables with the pruned entries zero) serves the same
        loaded = tf.saved_model.load(os.path.join(self.work, "fiited_export"))
        self.assertIn("serving_default", loaded.signatures)

    def test_a_dram_budget_tiers_the_largest_tables_and_trains_exactly(self):
        _skip_if_left_out(self, "tiered")
        # one process, the "one" run's flags, with DRAM for a fraction of the tables: the
        # planner moves the largest to the disk tier, and nothing else may change
        out = os.path.join(self.work, "tiered")
        done = self.jobs["tiered"]   # --dram_budget=DRAM_BUDGET
        self.assertEqual(done.returncode, 0, done.stderr[-5000:])
        with open(f"{out}.json") as f:
            tiered = json.load(f)
        one = self.runs["one"][0]
        cached = [t["name"] for t in tiered["plan"]["tables"] if t["cache_rows"]]
        self.assertTrue(cached)
        self.assertFalse([t for t in one["plan"]["tables"] if t["cache_rows"]])
        for key in ("train_loss", "auc", "logloss"):
            self.assertEqual(tiered[key], one[key], key)

    def test_fiited_tables_in_the_tier_train_exactly_as_in_memory(self):
        _skip_if_left_out(self, "fiited_tiered")
        # a one-process FIITED run (adjusting every 10 batches) with DRAM for a fraction
        # of the tables: the planner tiers the largest, whose rows keep their FIITED
        # widths in the tier, and nothing else may change (on a mesh, bit for bit:
        # tests/test_tiers_fiited_distributed.py)
        for name in ("fiited_one", "fiited_tiered"):
            done = self.jobs[name]
            self.assertEqual(done.returncode, 0, done.stderr[-5000:])
        with open(os.path.join(self.work, "fiited_tiered.json")) as f:
            tiered = json.load(f)
        with open(os.path.join(self.work, "fiited_one.json")) as f:
            fiited = json.load(f)
        self.assertTrue([t for t in tiered["plan"]["tables"] if t["cache_rows"]])
        self.assertGreater(tiered["embedding_memory"]["store"], 0)
        self.assertLess(tiered["embedding_memory"]["embedding"],
                        fiited["embedding_memory"]["embedding"])
        self.assertEqual(tiered["fiited"]["chunks_kept"], fiited["fiited"]["chunks_kept"])
        for key in ("train_loss", "auc", "logloss"):
            self.assertEqual(tiered[key], fiited[key], key)

    def test_binary_input_trains_exactly_as_the_tsv_it_came_from(self):
        _skip_if_left_out(self, "binary")
        from tests.test_criteo_binary import _line
        from tfhybrid.train.preprocess import preprocess
        rng = np.random.default_rng(5)
        tsv, binary = os.path.join(self.work, "tsv"), os.path.join(self.work, "binary")
        for split, lines in (("train", 2048), ("eval", 1024)):
            os.makedirs(os.path.join(tsv, split))
            with open(os.path.join(tsv, split, "day_0"), "w") as f:
                f.writelines(_line(rng) + "\n" for _ in range(lines))
        preprocess(tsv, binary, workers=2, log=lambda _: None)
        runs = {}
        for dataset, folder in (("criteo_tsv", tsv), ("criteo_binary", binary)):
            out = os.path.join(self.work, f"{dataset}.json")
            done = _cli(COMMON_FLAGS[:1] + [f"--dataset={dataset}", f"--data_dir={folder}",
                                            "--steps=8", "--batch_size=256",
                                            "--eval_batches=4", "--model_parallel=1",
                                            f"--metrics_json={out}"] + COMMON_FLAGS[5:],
                        # two data-parallel ranks: each reads its own share of the files
                        np_=2)
            self.assertEqual(done.returncode, 0, done.stderr[-5000:])
            with open(out) as f:
                runs[dataset] = json.load(f)
        tsv_run, binary_run = runs["criteo_tsv"], runs["criteo_binary"]
        print(f"2x1, 8 steps: TSV loss {tsv_run['train_loss']:.6f} AUC {tsv_run['auc']:.6f}; "
              f"binary loss {binary_run['train_loss']:.6f} AUC {binary_run['auc']:.6f}")
        self.assertEqual(binary_run["mesh"], [2, 1])
        self.assertEqual(binary_run["steps"], 8)
        self.assertAllClose(binary_run["train_loss"], tsv_run["train_loss"], atol=1e-6)
        self.assertAllClose(binary_run["auc"], tsv_run["auc"], atol=1e-6)
        self.assertAllClose(binary_run["logloss"], tsv_run["logloss"], atol=1e-6)

    def test_keras_flag_chooses_keras_and_refuses_a_conflict(self):
        # --keras chose this module's Keras where TF_USE_LEGACY_KERAS was unset
        self.assertEqual(self.runs["one"][0]["keras"], KERAS_MAJOR)
        self.assertIn(f"Keras {KERAS_MAJOR}", self.runs["one"][1])
        # the user's setting wins over nothing: a conflict is refused, naming both values
        done = self.jobs["keras_conflict"]   # --keras=3, TF_USE_LEGACY_KERAS=1
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("--keras=3 asks for Keras 3, but TF_USE_LEGACY_KERAS='1' asks for "
                      "Keras 2", done.stderr)
        # every other run took this module's Keras from TF_USE_LEGACY_KERAS
        self.assertEqual(self.runs["mesh"][0]["keras"], KERAS_MAJOR)

    def test_bad_flags_name_the_value(self):
        done = self.jobs["bad_bottom"]   # --embedding_dim=16 --bottom_mlp_dims=32,8
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("--bottom_mlp_dims=[32, 8]", done.stderr)
        done = self.jobs["bad_top"]   # --top_mlp_dims=8,x
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("--top_mlp_dims=8,x", done.stderr)


class TrainConfigTest(tf.test.TestCase):

    def test_validate_names_the_field(self):
        from tfhybrid.train.app import TrainConfig, config_from_dict
        cases = [(dict(model="wide"), "--model='wide'"),
                 (dict(optimizer="lamb"), "--optimizer='lamb'"),
                 (dict(batch_size=0), "--batch_size=0"),
                 (dict(steps=-1), "--steps=-1"),
                 (dict(learning_rate=float("nan")), "--learning_rate=nan"),
                 (dict(restore=True), "--checkpoint_dir"),
                 (dict(model_parallel=0), "--model_parallel=0"),
                 (dict(embedding_optimizer="lamb"), "--embedding_optimizer='lamb'"),
                 (dict(dense_optimizer="ftrl"), "--dense_optimizer='ftrl'"),
                 (dict(embedding_learning_rate=0.0), "--embedding_learning_rate=0.0"),
                 (dict(dense_learning_rate=float("inf")), "--dense_learning_rate=inf"),
                 (dict(fiited_target=0.0, optimizer="rowwise_adagrad"),
                  "--fiited_target=0.0 must be a number in"),
                 (dict(fiited_target=0.5, fiited_chunks=3, optimizer="rowwise_adagrad"),
                  "--fiited_chunks=3 must divide --embedding_dim=16"),
                 (dict(fiited_target=0.5), "--fiited_target needs the tables trained by "
                                           "row-wise AdaGrad"),
                 (dict(fiited_target=0.5, optimizer="rowwise_adagrad",
                       replica_sync="weights"), "--replica_sync=gradients"),
                 (dict(fiited_every=0), "--fiited_every=0"),
                 (dict(dram_budget=0, store_dir="/tmp"), "--dram_budget=0"),
                 (dict(dram_budget=10**6), "--dram_budget=1000000 .* needs --store_dir")]
        for values, message in cases:
            with self.assertRaisesRegex(ValueError, message.replace("[", r"\[")):
                TrainConfig(**values).validate()
        with self.assertRaisesRegex(ValueError, "batchsize"):
            config_from_dict({"batchsize": 4})

    def test_sgd_updates_only_the_rows_a_sparse_gradient_names(self):
        # the app's SGD scatters into the touched rows and keeps no state per table
        from tfhybrid import mesh as mesh_lib
        from tfhybrid.train.app import TrainConfig, distributed_optimizer
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        try:
            table = tf.Variable(tf.ones([1000, 4]))
            opt = distributed_optimizer(TrainConfig(optimizer="sgd", learning_rate=0.5))
            grad = tf.IndexedSlices(tf.constant([[1.0, 2.0, 3.0, 4.0]] * 2),
                                    tf.constant([3, 3]), tf.constant([1000, 4]))
            @tf.function
            def step():
                opt.apply_gradients([(grad, table)])
            ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
            self.assertTrue({"ResourceScatterAdd", "ResourceScatterSub"} & ops, sorted(ops))
            step()
            expected = np.ones([1000, 4], np.float32)
            expected[3] -= 0.5 * 2 * np.array([1.0, 2.0, 3.0, 4.0], np.float32)
            self.assertAllEqual(table.numpy(), expected)
            variables = opt.variables() if callable(opt.variables) else opt.variables
            self.assertTrue(all(v.shape.num_elements() < 1000 for v in variables),
                            [(v.name, v.shape) for v in variables])
        finally:
            mesh_lib.reset()

    def test_separate_optimizers_for_tables_and_dense_layers(self):
        from tfhybrid import mesh as mesh_lib
        from tfhybrid import optimizers
        from tfhybrid.train.app import TrainConfig, distributed_optimizer
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        try:
            both = distributed_optimizer(TrainConfig(optimizer="rowwise_adagrad",
                                                     learning_rate=0.05))
            self.assertIsInstance(both, optimizers.RowWiseAdagrad)
            self.assertIsNone(both.embedding_optimizer)
            pair = distributed_optimizer(TrainConfig(
                optimizer="sgd", learning_rate=0.3, embedding_optimizer="rowwise_adagrad",
                embedding_learning_rate=0.05, dense_optimizer="adam",
                dense_learning_rate=0.003))
            self.assertIsInstance(pair, tf.keras.optimizers.Adam)
            self.assertAllClose(float(pair.learning_rate), 0.003)
            self.assertIsInstance(pair.embedding_optimizer, optimizers.RowWiseAdagrad)
            self.assertAllClose(float(pair.embedding_optimizer.learning_rate), 0.05)
            # a learning rate not given falls back to --learning_rate
            fallback = distributed_optimizer(TrainConfig(optimizer="sgd", learning_rate=0.3,
                                                         embedding_optimizer="adagrad"))
            self.assertAllClose(float(fallback.embedding_optimizer.learning_rate), 0.3)
        finally:
            mesh_lib.reset()


if __name__ == "__main__":
    tf.test.main()
