"""tfhybrid.serving on a real Redis Cluster (3 masters, 3 replicas, password-protected).

The module starts the cluster once (tfhybrid.testing.redis_cluster) and one 4-rank job
(tests/_serving_job.py): a user model with a row-wise, a column-sliced, a table-wise and a
replicated table beside a Keras Embedding, and the app's DLRM and DCN-v2, trained on 2 x 2
and exported with external tables (DLRM also in float16 and int8), then trained on with
PublishDeltas(every_steps=10) while rank 0 serves. A fresh process that imports neither
Horovod nor tfhybrid's op library serves every export (tests/_serving_fresh.py). The
tests compare what it served with each model's predict, check malformed requests, a
wrong password and an evicting store, and kill a master while requests run.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np
from redis.crc import key_slot

from tests.runner import TEST_ENV
from tfhybrid.serving import Predictor, RedisStore
from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.testing.redis_cluster import LocalRedisCluster
from tfhybrid.train import app as train_app
from tfhybrid.train.metrics import roc_auc

# it starts a Redis Cluster and a horovodrun job of its own
STARTS_JOBS = True
KERAS = (2, 3)
RUN_TIMEOUT_S = 600

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")
# hard caps: the job (start-up included), the fresh process, a failover
JOB_TIMEOUT_S = 420
FRESH_TIMEOUT_S = 180
FAILOVER_TIMEOUT_S = 60
# what a RedisStore's user needs (docs/serving.md)
ACL_COMMANDS = ["+mget", "+mset", "+del", "+wait", "+ping", "+info", "+cluster|slots",
                "+config|get", "+command"]


def _run(command: list, timeout: float, env: dict | None = None
         ) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **TEST_ENV, **(env or {})}
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(command, env=full_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


class ServingTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="test-serving-")
        cls.addClassCleanup(shutil.rmtree, cls.work, True)
        cls.cluster = LocalRedisCluster(masters=3, replicas=1)
        cls.addClassCleanup(cls.cluster.stop)
        cls.cluster.start()
        cls.nodes = ",".join(cls.cluster.nodes)
        cls.password_file = os.path.join(cls.work, "password")
        with open(cls.password_file, "w") as f:
            f.write(cls.cluster.password)
        # rank 0 writes SavedModels while the other ranks wait in a collective: on a
        # machine busy with other tests that can outlast the suite's 45 s stall shutdown
        cls.job = _run([HOROVODRUN, "-np", "4", "-H", "localhost:4", "--gloo",
                        "--start-timeout", "60", PYTHON, "-m", "tests._serving_job",
                        cls.work, cls.nodes, cls.password_file], JOB_TIMEOUT_S,
                       env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"})
        cls.report = None
        if cls.job.returncode == 0:
            with open(os.path.join(cls.work, "job.json")) as f:
                cls.report = json.load(f)
            cls.expected = dict(np.load(os.path.join(cls.work, "expected.npz")))
            cls.user_probe = dict(np.load(os.path.join(cls.work, "user_probe.npz")))

    def setUp(self):
        # the first rank's traceback, not only the shutdown it caused on the others
        output = self.job.stdout + self.job.stderr
        first = output.find("Traceback")
        # Horovod's own messages say why it shut down
        horovod = [line for line in output.splitlines() if "[Horovod]" in line
                   or "horovod" in line.lower() and "error" in line.lower()]
        self.assertEqual(self.job.returncode, 0,
                         f"the 2x2 job failed:\n{output[max(0, first - 500):first + 5000]}"
                         f"\n...\n{output[-3000:]}\nHorovod's messages:\n"
                         + "\n".join(horovod[:40]))

    def _store(self, **kwargs) -> RedisStore:
        store = RedisStore(self.nodes, password=self.cluster.password, key_prefix="job-user",
                           **kwargs)
        self.addCleanup(store.close)
        return store

    def test_a_served_scores_equal_predict_in_a_fresh_process(self):
        self.assertEqual(self.report["user_kinds"], {
            "rowwise": "row_wise", "sliced": "column_wise", "tablewise": "table_wise",
            "replicated": "data_parallel"})
        fresh = _run([PYTHON, "-m", "tests._serving_fresh", self.work, self.nodes,
                      self.password_file], FRESH_TIMEOUT_S)
        self.assertEqual(fresh.returncode, 0, fresh.stderr[-5000:])
        said = json.loads(fresh.stdout.strip().splitlines()[-1])
        self.assertEqual(said["imported"], [])
        # the row cache: a request's second call reads the user tables' rows from it, and
        # serves what a predictor without a cache serves, bit for bit
        self.assertEqual(said["cache"]["second_call_keys"], 0)
        self.assertGreater(said["cache"]["second_call_hits"], 0)
        self.assertTrue(said["cache"]["same_as_uncached"])
        served = dict(np.load(os.path.join(self.work, "served.npz")))
        for name in ("user", "dlrm_float32", "dcnv2_float32", "dynamic", "dynamic_inline",
                     "ragged", "ragged_lists", "ragged_feature_ids"):
            model = name.split("_")[0]
            np.testing.assert_allclose(served[name], self.expected[model], rtol=0, atol=1e-6,
                                       err_msg=name)
        # the ragged model (per-id weights: a ragged mean bag with weights <= 0, a sqrtn
        # bag of three) had replicas drifted apart (synced by weights every 1000 steps):
        # the export synced them, and serves what the synced model predicts
        before = [np.load(os.path.join(self.work, f"ragged_before_{r}.npy")) for r in range(4)]
        self.assertGreater(max(np.abs(b - before[0]).max() for b in before), 1e-4)
        # ids that are columns of an input are read from the request; string keys, which
        # the model hashes, come from the SavedModel's feature_ids
        sources = {name: manifest_lib.read(path)["id_sources"]
                   for name, path in self.report["exports"].items()}
        self.assertEqual(sorted(sources["ragged"]), ["ragged_tables__f0", "ragged_tables__f1",
                                                     "ragged_tables__f2"])
        self.assertEqual(sources["ragged"]["ragged_tables__f0"],
                         {"input": "words.values", "unpacked": []})
        self.assertEqual(sources["dlrm_float32"]["embedding__f2"],
                         {"input": "categorical", "unpacked": [[1, 2]]})
        self.assertIsNotNone(sources["user"])
        self.assertIsNone(manifest_lib.read(self.report["dynamic_exports"]["external"])[
            "id_sources"])
        # dynamic tables: keys never trained read the default row, counted (once per call)
        default_rows = json.loads(fresh.stdout.strip().splitlines()[-1])["default_rows"]
        self.assertEqual(default_rows, self.report["dynamic_default_rows"])
        self.assertGreater(default_rows, 0)
        # int8 rows, the sliced table's two slices each with their own scale and offset:
        # close to predict, not equal (the rows really are quantized)
        int8_error = np.abs(served["user_int8"] - self.expected["user"]).max()
        self.assertLess(int8_error, 1e-2)
        self.assertGreater(int8_error, 0.0)
        sliced = [t for t in manifest_lib.read(self.report["exports"]["user_int8"])["layers"][
            0]["tables"] if t["key"] == "user_tables.sliced"][0]
        self.assertEqual(sliced["slices"], [[0, 8], [8, 16]])
        self.assertEqual(sliced["value_bytes"], [16, 16])   # 8 bytes + scale and offset
        labels = np.load(os.path.join(self.work, "app_eval.npz"))["labels"].ravel()
        auc = {p: roc_auc(labels, served[f"dlrm_{p}"].ravel())
               for p in ("float32", "float16", "int8")}
        sizes = {}
        for p in auc:
            table = manifest_lib.read(self.report["exports"][f"dlrm_{p}"])["layers"][0][
                "tables"][0]
            sizes[p] = table["value_bytes"][0]
        print(f"DLRM on synthetic data, AUC by row precision: "
              + ", ".join(f"{p} {a:.5f} ({sizes[p]} B/row of width 8)"
                          for p, a in auc.items()))
        self.assertLess(abs(auc["float16"] - auc["float32"]), 0.001)
        self.assertLess(abs(auc["int8"] - auc["float32"]), 0.001)
        self.assertEqual(sizes, {"float32": 32, "float16": 16, "int8": 16})
        # a stock SavedModel: saved_model_cli (plain TensorFlow) sees both signatures
        shown = _run([os.path.join(os.path.dirname(PYTHON), "saved_model_cli"), "show",
                      "--dir", self.report["exports"]["user"], "--all"], FRESH_TIMEOUT_S)
        self.assertEqual(shown.returncode, 0, shown.stderr[-3000:])
        for signature in ("serving_default", "external_rows", "feature_ids"):
            self.assertIn(f"signature_def['{signature}']", shown.stdout)

    def test_b_malformed_requests_raise_value_error_naming_the_input(self):
        predictor = Predictor(self.report["exports"]["user"], self._store())
        probe = {k: v[:4] for k, v in self.user_probe.items()}
        predictor(probe)
        cases = [
            ({k: v for k, v in probe.items() if k != "local"}, "local"),        # missing
            (dict(probe, extra=probe["local"]), "extra"),                      # unexpected
            (dict(probe, dense=probe["dense"].astype(np.int32)), "dense"),    # dtype
            (dict(probe, rowwise=probe["rowwise"][:, 0]), "rowwise"),         # rank
            (dict(probe, sliced=probe["sliced"] + 600), "sliced"),            # id range
        ]
        for inputs, name in cases:
            with self.assertRaisesRegex(ValueError, name):
                predictor(inputs)
        with self.assertRaisesRegex(ValueError, "got 2 inputs"):
            predictor([probe["rowwise"], probe["sliced"]])

    def test_c_wrong_password_and_an_evicting_store_are_refused(self):
        with self.assertRaisesRegex(PermissionError, "refused user 'default'"):
            RedisStore(self.nodes, password="not-the-password").check_settings()
        store = self._store()
        masters = self.cluster.masters()
        self.cluster.cli(masters[0], "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        try:
            with self.assertRaisesRegex(ValueError, f"{masters[0]} has maxmemory-policy="
                                                    "'allkeys-lru'"):
                store.check_settings()
        finally:
            self.cluster.cli(masters[0], "CONFIG", "SET", "maxmemory-policy", "noeviction")
        self.assertEqual(store.check_settings()["maxmemory-policy"], "noeviction")
        # an ACL user limited to its model's keys (the commands docs/serving.md lists)
        for node in self.cluster.alive():
            self.cluster.cli(node, "ACL", "SETUSER", "served", "on", ">s3cret", "~job-user/*",
                             "resetchannels", *ACL_COMMANDS)
        limited = RedisStore(self.nodes, username="served", password="s3cret",
                             key_prefix="job-user")
        self.addCleanup(limited.close)
        self.assertEqual(limited.check_settings()["maxmemory-policy"], "noeviction")
        self.assertIsNotNone(limited.get([limited.row_key("user_tables.rowwise", 0)])[0])
        with self.assertRaisesRegex(PermissionError, "refused user 'served'"):
            limited.put([b"job-dlrm_float32/x"], [b"1"])
        # a key the export never wrote is an error naming it, never a zero row
        predictor = Predictor(self.report["exports"]["user"], store)
        key = store.row_key("user_tables.tablewise", int(self.user_probe["tablewise"][0]))
        value = store.get([key])[0]
        store.client().delete(key)
        try:
            with self.assertRaisesRegex(LookupError, key.decode()):
                predictor(self.user_probe)
        finally:
            store.put([key], [value])

    def test_d_deltas_write_changed_rows_and_serve_the_step_model(self):
        deltas = self.report["deltas"]
        self.assertEqual([d["step"] for d in deltas], [10, 20, 30])
        rows = self.report["table_rows"]
        # the first publish writes every row (the sliced table once per slice), later
        # ones only those changed: fewer than all, more than none
        every = rows["rowwise"] + 2 * rows["sliced"] + rows["tablewise"] + rows["replicated"]
        self.assertEqual(deltas[0]["rows"], every)
        for d in deltas[1:]:
            self.assertGreater(d["rows"], 0)
            self.assertLess(d["rows"], every)
        for d in deltas:
            self.assertLessEqual(d["max_diff"], 1e-6, d)
        print("rows per publish (every 10 steps): "
              + ", ".join(str(d["rows"]) for d in deltas) + f" of {every}")
        # versions beyond keep_versions=2 are removed
        self.assertEqual(self.report["delta_versions"], ["2", "3"])

    def test_d_dynamic_deltas_delete_evicted_keys(self):
        deltas = self.report["dynamic_deltas"]
        self.assertEqual([d["step"] for d in deltas], [5, 10, 15])
        for d in deltas:
            self.assertLessEqual(d["max_diff"], 1e-6, d)
        # keys drift past the capacity: evicted keys leave the store
        self.assertEqual(deltas[0]["deleted"], 0)
        self.assertGreater(sum(d["deleted"] for d in deltas), 0)
        print("dynamic table, keys deleted per publish: "
              + ", ".join(str(d["deleted"]) for d in deltas))

    def test_e_a_killed_master_fails_over_and_scores_stay_right(self):
        store = self._store(timeout_s=2.0)
        # no row cache: every request reads the store, through the failover
        predictor = Predictor(self.report["exports"]["user"], store, deadline_s=2.0,
                              cache_mb=0)
        reference = predictor(self.user_probe)["output"]
        # the master that serves the first key of the row-wise table
        key = store.row_key("user_tables.rowwise", 0)
        store.client()
        victim = store.client().nodes_manager.get_node_from_slot(key_slot(key)).name
        results: list = []
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                began = time.monotonic()
                try:
                    out = predictor(self.user_probe)["output"]
                    results.append((began, time.monotonic(), out))
                except Exception as e:
                    results.append((began, time.monotonic(), e))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        time.sleep(0.5)
        killed_at = time.monotonic()
        self.cluster.kill(victim)
        deadline = killed_at + FAILOVER_TIMEOUT_S
        while time.monotonic() < deadline:
            after = [r for r in results if r[0] > killed_at and not isinstance(r[2], Exception)]
            if len(after) >= 3:
                break
            time.sleep(0.2)
        stop.set()
        thread.join(timeout=30)
        self.assertFalse(thread.is_alive())
        answered = [r for r in results if not isinstance(r[2], Exception)]
        failed = [r for r in results if isinstance(r[2], Exception)]
        self.assertGreaterEqual(len([r for r in answered if r[0] > killed_at]), 3,
                                f"no answer within {FAILOVER_TIMEOUT_S} s of the kill; "
                                f"errors: {[str(r[2])[:200] for r in failed[-3:]]}")
        # no request returned a wrong score, before, during or after the failover
        for _, _, out in answered:
            np.testing.assert_allclose(out, reference, rtol=0, atol=0)
        # errors name the unavailable node or the deadline
        for _, _, error in failed:
            self.assertRegex(str(error), "node|deadline|127.0.0.1")
        first_after = min(r[1] for r in answered if r[0] > killed_at)
        last_before = max([r[1] for r in answered if r[1] <= killed_at], default=killed_at)
        print(f"master {victim} killed: answers resumed {first_after - killed_at:.1f} s "
              f"later ({len(failed)} requests failed meanwhile, gap between answers "
              f"{first_after - last_before:.1f} s); every answer equal to the reference")
        self.assertIn(victim, [n for n in self.cluster.nodes if n not in self.cluster.alive()])


class AppFlagsTest(unittest.TestCase):
    """The app's serving flags are checked before anything starts
    (`make serve-demo` runs them end to end)."""

    def test_bad_serving_flags_name_the_flag(self):
        for fields, flag in [(dict(export_tables="remote"), "--export_tables"),
                             (dict(export_precision="int4"), "--export_precision"),
                             (dict(export_tables="external", export_dir="/tmp/x"), "--redis"),
                             (dict(redis_password_file="/nonexistent/pw"),
                              "--redis_password_file")]:
            with self.assertRaisesRegex(ValueError, flag):
                train_app.TrainConfig(**fields).validate()
        train_app.TrainConfig(export_tables="external", export_dir="/tmp/x",
                              redis="127.0.0.1:7000", export_precision="int8").validate()


if __name__ == "__main__":
    unittest.main()
