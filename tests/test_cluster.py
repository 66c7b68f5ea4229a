"""tfhybrid on an emulated 2-node x 2-rank cluster (tfhybrid.testing.cluster).

The jobs are real multi-host Horovod jobs (`horovodrun -H node0:2,node1:2 --gloo`,
node1 reached over ssh) across a link shaped by tc: the 2D parity tests (2x2 and the
other meshes vs a single-process model, both layouts), Keras `fit` / `evaluate` /
`predict`, and the training app in both layouts. A model group is inside a node in the
model-major layout and spans the nodes in the data-major one, so both kinds of process
set cross the link. The harness must start (CI runs as root): if it cannot, these tests
fail, they do not skip. The module runs in one plain process (no HOROVOD_NP).
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

from tests.runner import ROOT, TEST_ENV, read_reports
from tfhybrid.testing import cluster as cluster_lib

# it starts multi-process jobs of its own: tests/runner.py runs it beside one-process
# modules only
STARTS_JOBS = True

# tests/runner.py: each job below is bounded by JOB_TIMEOUT_S, the module by this
RUN_TIMEOUT_S = 1200
RANKS_PER_NODE = 2
NODES = 2
# a NIC rate this machine's CPUs can saturate (above ~1 Gbit/s the cores are the limit)
BANDWIDTH_MBIT = 500
JOB_TIMEOUT_S = 300
PYTHON = sys.executable


def _env() -> dict:
    env = dict(TEST_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _tx_bytes(namespace: str) -> int:
    """Bytes the node's NIC has sent (its shaped side of the link)."""
    out = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show",
                          cluster_lib.NODE_INTERFACE], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


def _cluster_processes() -> list[str]:
    """Command lines of running processes that use an emulated cluster's files."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "tfhybrid-cluster-" in cmdline and "sshd" in cmdline:
            found.append(cmdline)
    return found


class ClusterJobsTest(unittest.TestCase):
    """One 2 x 2 cluster for the whole class: it takes a few seconds to build."""

    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster_lib.EmulatedCluster(NODES, RANKS_PER_NODE, BANDWIDTH_MBIT)
        cls.cluster.up()
        print(f"\nemulated cluster {cls.cluster.host_flag()} at {BANDWIDTH_MBIT} Mbit/s: "
              f"up in {cls.cluster.setup_seconds:.1f} s", flush=True)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.down()
        print(f"emulated cluster torn down in {cls.cluster.teardown_seconds:.1f} s",
              flush=True)
        assert cluster_lib.leftovers() == [], cluster_lib.leftovers()

    def _run_tests(self, module: str, *names: str) -> dict:
        """Runs the selected tests of ``module`` on every rank of the cluster; every one
        must pass on every rank. Returns the merged outcomes."""
        reports = tempfile.mkdtemp(prefix="tfhybrid-cluster-test-")
        size = NODES * RANKS_PER_NODE
        sent_before = _tx_bytes(self.cluster.nodes[1].namespace)
        result = self.cluster.horovodrun(
            [PYTHON, os.path.join(ROOT, "tests", "_rank_main.py"),
             os.path.join(ROOT, module), reports, *names],
            timeout=JOB_TIMEOUT_S, env=_env(), cwd=ROOT)
        outcomes, missing = read_reports(reports, size)
        tail = result.stdout[-6000:]
        self.assertEqual(missing, [], tail)
        self.assertTrue(outcomes, tail)
        for name in names:
            self.assertTrue(any(name in test_id for test_id in outcomes),
                            f"{name} did not run:\n{tail}")
        failed = {t: o["detail"] for t, o in outcomes.items() if o["status"] != "pass"}
        self.assertEqual(failed, {}, tail)
        self.assertEqual(result.returncode, 0, tail)
        # node1's ranks talked to node0's over the shaped link, not some other path
        self.assertGreater(_tx_bytes(self.cluster.nodes[1].namespace) - sent_before, 0)
        return outcomes

    def test_ranks_are_placed_on_two_hosts_and_links_are_shaped(self):
        script = textwrap.dedent("""
            import socket, horovod.tensorflow as hvd
            hvd.init()
            print(f"rank {hvd.rank()} local {hvd.local_rank()} on "
                  f"{socket.gethostbyname(socket.gethostname())}", flush=True)
            hvd.join()
        """)
        result = self.cluster.horovodrun([PYTHON, "-c", script], timeout=JOB_TIMEOUT_S,
                                         env=_env())
        self.assertEqual(result.returncode, 0, result.stdout[-6000:])
        placed = dict(re.findall(r"rank (\d) local \d on (198\.18\.0\.\d+)", result.stdout))
        self.assertEqual(placed, {"0": self.cluster.nodes[0].address,
                                  "1": self.cluster.nodes[0].address,
                                  "2": self.cluster.nodes[1].address,
                                  "3": self.cluster.nodes[1].address})
        for node in self.cluster.nodes:
            qdisc = subprocess.run(["ip", "netns", "exec", node.namespace, "tc", "qdisc",
                                    "show", "dev", cluster_lib.NODE_INTERFACE],
                                   capture_output=True, text=True, check=True).stdout
            self.assertRegex(qdisc, rf"tbf .*rate {BANDWIDTH_MBIT}Mbit")

    def test_2d_parity_every_mesh_both_layouts(self):
        # meshes 4x1, 2x2 and 1x4, model- and data-major, each against one process
        # training the same model on the global batch
        outcomes = self._run_tests("tests/test_distributed_embedding.py",
                                   "ParityTest.test_sgd_parity_every_mesh")
        self.assertIn("tests.test_distributed_embedding.ParityTest."
                      "test_sgd_parity_every_mesh", outcomes)

    def test_keras_fit_evaluate_predict_on_2x2(self):
        # fit on the model-major 2x2 mesh equals a custom loop; evaluate and predict on
        # the data-major one equal a single process
        outcomes = self._run_tests("tests/test_fit.py",
                                   "FitTest.test_fit_equals_custom_loop_on_2x2",
                                   "FitTest.test_evaluate_and_predict_match_single_process")
        self.assertEqual(len(outcomes), 2)

    def test_training_app_fit_across_the_nodes(self):
        # the layouts' placement is test_2d_parity_every_mesh_both_layouts' job: the app
        # runs in the one that splits model groups across the nodes
        for layout in ("data_major",):
            with self.subTest(layout=layout):
                metrics = tempfile.mktemp(prefix="tfhybrid-cluster-", suffix=".json")
                result = self.cluster.horovodrun(
                    [PYTHON, "-m", "tfhybrid.train", "--model=dlrm", "--dataset=synthetic",
                     "--model_parallel=2", f"--layout={layout}", "--steps=20",
                     "--batch_size=64", "--eval_batches=2", "--embedding_dim=8",
                     "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
                     "--max_table_rows=5000", f"--metrics_json={metrics}"],
                    timeout=JOB_TIMEOUT_S, env=_env(), cwd=ROOT)
                self.assertEqual(result.returncode, 0, result.stdout[-6000:])
                with open(metrics) as f:
                    results = json.load(f)
                os.remove(metrics)
                self.assertEqual(results["steps"], 20)
                self.assertEqual(results["mesh"], [2, 2])
                self.assertEqual(results["layout"], layout)
                self.assertTrue(0.0 <= results["auc"] <= 1.0, results)


_LIFECYCLE = textwrap.dedent("""
    import os, signal, sys, time
    from tfhybrid.testing import cluster as cluster_lib
    # Ctrl-C as in a terminal: a test run started in the background (nohup, `cmd &`)
    # hands its children SIGINT ignored, and Python then raises no KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    how = sys.argv[1]
    c = cluster_lib.EmulatedCluster(2, 1, bandwidth_mbit=100)
    if how == "context-error":
        try:
            with c:
                print("UP", flush=True)
                raise RuntimeError("boom")
        except RuntimeError:
            sys.exit(3)
    with c:
        print("UP", flush=True)
        if how == "exit":
            pass
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            time.sleep(120)   # waits for the parent's SIGINT / SIGTERM
""")


class ClusterLifecycleTest(unittest.TestCase):
    """Nothing is left behind: not on exit, on an error, on Ctrl-C, on SIGTERM, and a
    cluster whose owner was killed is removed by the next one."""

    def _owner(self, how: str, send=None) -> int:
        proc = subprocess.Popen([PYTHON, "-c", _LIFECYCLE, how], cwd=ROOT, env={
            **os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        first = proc.stdout.readline()
        self.assertEqual(first.strip(), "UP", first + proc.stdout.read()[-3000:]
                         if proc.poll() is not None else first)
        self.assertTrue(cluster_lib.leftovers())  # it really made namespaces
        if send is not None:
            proc.send_signal(send)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return proc.returncode

    def test_nothing_left_after_exit_error_ctrl_c_and_sigterm(self):
        for how, send, code in [("exit", None, 0), ("context-error", None, 3),
                                ("wait", signal.SIGINT, -signal.SIGINT),
                                # SIGTERM is turned into a KeyboardInterrupt, so teardown runs
                                ("wait", signal.SIGTERM, -signal.SIGINT)]:
            with self.subTest(how=how, signal=send):
                self.assertEqual(self._owner(how, send), code)
                self.assertEqual(cluster_lib.leftovers(), [])
                # no sshd (nor anything else) of the cluster outlives it
                self.assertEqual(_cluster_processes(), [])

    def test_a_killed_owners_cluster_is_removed_by_the_next(self):
        self.assertEqual(self._owner("kill"), -signal.SIGKILL)
        left = cluster_lib.leftovers()
        self.assertTrue(left)
        self.assertEqual(sorted(cluster_lib.remove_orphans()), left)
        self.assertEqual(cluster_lib.leftovers(), [])

    def test_bad_arguments_name_the_value(self):
        with self.assertRaisesRegex(ValueError, "nodes .* got 0"):
            cluster_lib.EmulatedCluster(nodes=0)
        with self.assertRaisesRegex(ValueError, "bandwidth_mbit .* got -1"):
            cluster_lib.EmulatedCluster(bandwidth_mbit=-1)
        with self.assertRaisesRegex(ValueError, "ranks_per_node .* got 1.5"):
            cluster_lib.EmulatedCluster(ranks_per_node=1.5)


if __name__ == "__main__":
    unittest.main()
