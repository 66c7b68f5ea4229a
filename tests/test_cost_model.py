"""The cost model and the cost strategy: pure Python, single process, no TF or Horovod."""

from __future__ import annotations

import doctest
import json
import math
import sys
import unittest

from tfhybrid import plan as planning
from tfhybrid.plan import (calibration, cost_strategy, strategies, tiers, traffic,
                           types as plan_types)
from tfhybrid.plan import cost_model as plan_cost_model
from tfhybrid.plan import planner as plan_planner
from tfhybrid.plan import (ClusterSpec, ComputeRates, ShardingPlan, TableConfig, Workload,
                           calibrate, expected_unique_rows, plan_for_cluster, plan_sharding,
                           predict, validate)

RATES = ComputeRates(1e9, {"sgd": 2e9, "rowwise_adagrad": 1e9}, 1e-7, 1e-3, 1e-4)


def _cluster(nodes=2, per_node=2, inter=1.25e8, memory=1 << 30, **kw) -> ClusterSpec:
    kw.setdefault("rates", RATES)
    return ClusterSpec(nodes, per_node, 1e10, inter, 0.0, 0.0, memory, **kw)


class LinkBytesTest(unittest.TestCase):
    """Bytes per link against hand computation: 2 nodes x 2 ranks, one table on p0."""

    TABLE = TableConfig("t", 1000, 8)   # float32, hotness 1, pooled

    def _predict(self, d, m, layout, **work):
        work.setdefault("optimizer", "sgd")
        work.setdefault("unique_fraction", 1.0)   # every looked-up id a distinct row
        w = Workload((self.TABLE,), local_batch_size=4, **work)
        plan = plan_sharding([self.TABLE], d, m, local_batch_size=4)
        self.assertEqual(plan.table("t").shards[0].owner, 0)
        return predict(plan, layout, _cluster(), w)

    def test_alltoall_1d(self):
        # M = 4 over nodes {0, 0, 1, 1}. Non-owners send (4 lengths + 4 ids) * 4 B = 32 B of
        # ids, spread over 3 peers: rank 1 keeps 1/3 on its node, ranks 2 and 3 send 2/3
        # each through node 1's NIC: 2 * 32 * 2/3.
        pred = self._predict(1, 4, "model_major")
        ids = pred.collective("alltoall_ids")
        self.assertTrue(ids.spans_nodes)
        self.assertEqual(ids.bytes_per_rank, 32.0)
        self.assertAlmostEqual(ids.max_nic_bytes, 2 * 32 * 2 / 3)
        self.assertAlmostEqual(ids.max_intra_link_bytes, 32 / 3)
        # the owner (rank 0) sends 3 * (4 bags * 8 values * 4 B) = 384 B of activations:
        # 1/3 to rank 1 on its node, 2/3 through node 0's NIC
        act = pred.collective("alltoall_activations")
        self.assertEqual(act.bytes_per_rank, 384.0)
        self.assertAlmostEqual(act.max_nic_bytes, 256.0)
        self.assertAlmostEqual(act.max_intra_link_bytes, 128.0)
        grads = pred.collective("alltoall_activation_grads")
        self.assertEqual(grads.bytes_per_rank, 128.0)   # each non-owner: its 4 rows back
        # seconds = the NIC's bytes at 1.25e8 B/s (no latency, intra link 80x faster)
        self.assertAlmostEqual(act.seconds, 256.0 / 1.25e8)

    def test_alltoall_2d_layouts(self):
        inside = self._predict(2, 2, "model_major")
        for name in ("alltoall_ids", "alltoall_activations", "alltoall_activation_grads"):
            c = inside.collective(name)
            self.assertFalse(c.spans_nodes, name)
            self.assertEqual(c.max_nic_bytes, 0.0, name)
        # data_major: model groups {0, 2} and {1, 3} cross nodes; position = rank // D, so
        # ranks 0 and 1 own the table and each sends 4 * 8 * 4 = 128 B through node 0's NIC
        across = self._predict(2, 2, "data_major")
        act = across.collective("alltoall_activations")
        self.assertTrue(act.spans_nodes)
        self.assertEqual(act.max_nic_bytes, 256.0)
        self.assertEqual(act.max_intra_link_bytes, 0.0)
        self.assertGreater(across.step_seconds, inside.step_seconds)

    def test_ring_allreduce_and_sync(self):
        # dense 1000 float32 = 4000 B over a ring 0-1-2-3: every edge carries
        # 2 * 3/4 * 4000 = 6000 B; edges 1->2 and 3->0 cross a NIC
        pred = self._predict(2, 2, "model_major", dense_parameters=1000)
        dense = pred.collective("dense_allreduce")
        self.assertEqual((dense.group_size, dense.bytes_per_rank), (4, 4000.0))
        self.assertAlmostEqual(dense.max_nic_bytes, 6000.0)
        self.assertAlmostEqual(dense.max_intra_link_bytes, 6000.0)
        self.assertAlmostEqual(dense.seconds, 6000.0 / 1.25e8)
        # shard gradient sync in model_major: data group {0, 2} crosses nodes; the owner's
        # group saw M*b = 8 ids, sparse (8 * 9 < 8000): 8 * (8 * 4 + 8) = 320 B, allgather of
        # 2 ranks: every edge carries (n-1) * U = 320 B
        sync = pred.collective("shard_grad_allgather")
        self.assertEqual(sync.bytes_per_rank, 320.0)
        self.assertTrue(sync.spans_nodes)
        self.assertEqual(sync.max_nic_bytes, 320.0)
        self.assertEqual(sync.calls_per_step, 2)   # values and indices
        # data_major keeps the data groups {0, 1}, {2, 3} inside nodes
        self.assertFalse(self._predict(2, 2, "data_major", dense_parameters=1000)
                         .collective("shard_grad_allgather").spans_nodes)
        hier = predict(plan_sharding([self.TABLE], 2, 2, local_batch_size=4), "model_major",
                       _cluster(allreduce="hierarchical"),
                       Workload((self.TABLE,), 4, dense_parameters=1000, optimizer="sgd"))
        # hierarchical: NIC 2 (k-1)/k * S = 4000 per node, intra 2 (c-1)/c * S = 4000 per rank
        self.assertAlmostEqual(hier.collective("dense_allreduce").max_nic_bytes, 4000.0)
        self.assertAlmostEqual(hier.collective("dense_allreduce").max_intra_link_bytes, 4000.0)

    def test_weight_sync_and_fp16(self):
        w = self._predict(2, 2, "model_major", optimizer="rowwise_adagrad",
                          replica_sync="weights", sync_every=4)
        sync = w.collective("shard_weight_sync")
        # whole shard + row-wise state: 1000*8*4 + 1000*4, every 4 steps
        self.assertEqual(sync.bytes_per_rank, 36000.0)
        self.assertEqual(sync.calls_per_step, 0.25)
        self.assertNotIn("shard_grad_allgather", [c.name for c in w.collectives])
        full = self._predict(1, 4, "model_major")
        half = self._predict(1, 4, "model_major", comm_dtype="float16")
        self.assertEqual(half.collective("alltoall_activations").bytes_per_rank,
                         full.collective("alltoall_activations").bytes_per_rank / 2)
        self.assertEqual(half.collective("alltoall_ids").bytes_per_rank,
                         full.collective("alltoall_ids").bytes_per_rank)


    def test_overlap_hides_only_gradient_syncs(self):
        """The alltoalls and a weight sync stay on the critical path; the gradient syncs
        hide behind compute by ``overlap`` of the shorter of the two."""
        tables = (TableConfig("t", 1000, 8),)
        work = Workload(tables, local_batch_size=4, dense_parameters=100_000,
                        optimizer="sgd", unique_fraction=1.0)
        plan = plan_sharding(list(tables), 2, 2, local_batch_size=4)
        # compute (dense 1e-4 s/sample * 4 = 0.4 ms) exceeds the gradient syncs at 1.25e8
        slow_compute = ComputeRates(1e9, {"sgd": 2e9}, 1e-4, 1e-3, 1e-4)
        steps = {}
        for overlap in (0.0, 0.5):
            rates = ComputeRates(**{**slow_compute.__dict__, "overlap": overlap})
            for lay in ("model_major", "data_major"):
                steps[overlap, lay] = predict(plan, lay, _cluster(rates=rates), work)
        for lay in ("model_major", "data_major"):
            none, half = steps[0.0, lay], steps[0.5, lay]
            behind = [c for c in none.collectives if c.behind_compute]
            self.assertEqual({c.name for c in behind} - {"dense_allreduce",
                                                         "shard_grad_allreduce",
                                                         "shard_grad_allgather",
                                                         "replicated_allgather"}, set())
            self.assertIn("dense_allreduce", {c.name for c in behind})
            self.assertFalse(any(c.behind_compute for c in none.collectives
                                 if c.kind == "alltoall"))
            hidden = 0.5 * min(none.compute_seconds, none.behind_compute_seconds)
            self.assertGreater(hidden, 0.0)
            self.assertAlmostEqual(none.step_seconds - half.step_seconds, hidden, places=12)
        weights = Workload(tables, local_batch_size=4, optimizer="sgd",
                           replica_sync="weights", sync_every=2)
        sync = predict(plan, "model_major", _cluster(), weights).collective("shard_weight_sync")
        self.assertFalse(sync.behind_compute)

class MemoryTest(unittest.TestCase):

    def test_rowwise_adagrad_state(self):
        tables = [TableConfig("a", 1000, 16), TableConfig("b", 500, 8)]
        plan = plan_sharding(tables, 1, 2, optimizer="rowwise_adagrad")
        self.assertEqual(plan.optimizer, "rowwise_adagrad")
        self.assertEqual(sorted(r.optimizer_bytes for r in plan.ranks), [500 * 4, 1000 * 4])
        self.assertEqual(plan_sharding(tables, 1, 2).ranks[0].optimizer_bytes, 0)   # sgd
        adam = plan_sharding(tables, 1, 2, optimizer="adam")
        self.assertEqual(sorted(r.optimizer_bytes for r in adam.ranks),
                         [500 * 8 * 8, 1000 * 16 * 8])
        w = Workload(tuple(tables), 4, dense_parameters=100, dense_optimizer="adam")
        pred = predict(plan, "model_major", _cluster(1, 2), w)
        parts = dict(pred.memory_parts)
        self.assertEqual(parts["tables"], 1000 * 16 * 4)
        self.assertEqual(parts["optimizer state"], 1000 * 4)
        self.assertEqual(parts["dense + state"], 100 * 4 + 100 * 8)
        self.assertEqual(pred.memory_per_rank_bytes, math.ceil(sum(parts.values())))

    def test_unique_rows(self):
        self.assertAlmostEqual(expected_unique_rows(1000, 10**6, 0.0), 10**6 * -math.expm1(-1e-3))
        # exact sum for a small table
        rows, s, n = 500, 1.2, 300.0
        p = [i ** -s for i in range(1, rows + 1)]
        exact = sum(1 - math.exp(-n * x / sum(p)) for x in p)
        self.assertAlmostEqual(expected_unique_rows(n, rows, s), exact, places=6)
        big = expected_unique_rows(32768, 10**6)
        self.assertLess(big, 32768 * 0.6)
        self.assertGreater(big, 32768 * 0.1)
        # weights mode: the optimizer touches the group's rows, gradient mode the data group's
        t = TableConfig("t", 10**6, 16, hotness=8.0)
        w = Workload((t,), 512)
        plan = plan_sharding([t], 2, 2, optimizer="rowwise_adagrad", local_batch_size=512,
                             unique_rows=w.unique_rows)
        self.assertLess(plan.ranks[0].sync_bytes_per_step,
                        plan_sharding([t], 2, 2, optimizer="rowwise_adagrad",
                                      local_batch_size=512).ranks[0].sync_bytes_per_step)


class CostStrategyTest(unittest.TestCase):
    TABLES = (TableConfig("a", 200_000, 32, hotness=8.0), TableConfig("b", 200_000, 32,
                                                                      hotness=8.0))

    def _workload(self):
        return Workload(self.TABLES, 512, dense_parameters=10_000)

    def test_slow_link_picks_2d(self):
        cluster = _cluster(inter=1.25e7)   # 100 Mbit/s between nodes
        plan, layout, pred = plan_for_cluster(self.TABLES, cluster, self._workload())
        print("\n" + plan.describe(), file=sys.stderr)
        one_d = planning.plan_mesh(self.TABLES, 1, 4, "model_major", cluster,
                                     self._workload())
        one_d_pred = predict(one_d, "model_major", cluster, self._workload())
        self.assertTrue(one_d_pred.fits)
        self.assertLess(plan.model_parallel, 4)
        self.assertLess(pred.step_seconds, one_d_pred.step_seconds)
        self.assertEqual(plan.strategy, "cost")
        self.assertEqual(plan.layout, layout)
        self.assertEqual(dict(plan.predicted)["step_seconds"], pred.step_seconds)
        self.assertIn("predicted by the cost model", plan.describe())
        back = ShardingPlan.from_json(plan.to_json())
        self.assertEqual(back, plan)
        # the same through plan_sharding(strategy="cost") on that mesh
        same = plan_sharding(self.TABLES, plan.data_parallel, plan.model_parallel,
                             strategy="cost", cluster=cluster, workload=self._workload(),
                             layout=layout)
        self.assertEqual(same, plan)

    def test_memory_forbids_2d(self):
        cluster = _cluster(inter=1.25e7)

        def least_memory(m):   # every table row-wise: the even split
            plan = planning.plan_with_kinds(self.TABLES, 4 // m, m, [("row_wise", m)] * 2,
                                           optimizer="rowwise_adagrad", local_batch_size=512)
            return predict(plan, "model_major", cluster, self._workload()).memory_per_rank_bytes

        self.assertLess(least_memory(4), least_memory(2))
        tight = _cluster(inter=1.25e7, memory=(least_memory(4) + least_memory(2)) // 2)
        plan, _, pred = plan_for_cluster(self.TABLES, tight, self._workload())
        self.assertEqual(plan.model_parallel, 4)
        self.assertTrue(pred.fits)
        with self.assertRaisesRegex(ValueError, r"memory_per_rank=1000\b"):
            plan_for_cluster(self.TABLES, _cluster(memory=1000), self._workload())

    def test_fast_link_is_not_worse_than_1d(self):
        cluster = _cluster(inter=1e12)
        plan, _, pred = plan_for_cluster(self.TABLES, cluster, self._workload())
        for m in (1, 2, 4):
            for lay in ("model_major", "data_major"):
                other = planning.plan_mesh(self.TABLES, 4 // m, m, lay, cluster,
                                             self._workload())
                self.assertLessEqual(pred.step_seconds,
                                     predict(other, lay, cluster, self._workload()).step_seconds)


class SerializationAndErrorsTest(unittest.TestCase):

    def test_round_trips(self):
        c = _cluster(allreduce="hierarchical")
        self.assertEqual(ClusterSpec.from_json(c.to_json()), c)
        w = Workload((TableConfig("a", 10, 4, dtype="float16"),), 8, 5, "adagrad", "sgd",
                     "weights", 3, "float16", (0.5,), 1.1)
        self.assertEqual(Workload.from_json(w.to_json()), w)
        self.assertEqual(ComputeRates.from_dict(json.loads(json.dumps(RATES.to_dict()))), RATES)
        # a plan saved before optimizer/sync/layout/predicted existed reads with defaults
        plan = plan_sharding([TableConfig("a", 10, 4)], 1, 2, optimizer="rowwise_adagrad",
                             replica_sync="weights", sync_every=5, comm_dtype="float16")
        self.assertEqual(ShardingPlan.from_json(plan.to_json()), plan)
        old = json.loads(plan.to_json())
        for key in ("optimizer", "replica_sync", "sync_every", "comm_dtype", "layout",
                    "predicted"):
            del old[key]
        back = ShardingPlan.from_json(json.dumps(old))
        self.assertEqual((back.optimizer, back.replica_sync, back.layout, back.predicted),
                         ("sgd", "gradients", None, ()))

    def test_value_errors(self):
        t = (TableConfig("a", 10, 4),)
        cases = [
            (lambda: _cluster(nodes=0), r"nodes.*0"),
            (lambda: ClusterSpec(1, 2, -1.0, 1e9, 0, 0, 10, RATES), r"intra_node_bandwidth.*-1"),
            (lambda: ClusterSpec(1, 2, 1e9, 1e9, -2, 0, 10, RATES), r"intra_node_latency.*-2"),
            (lambda: ClusterSpec(1, 2, 1e9, 1e9, 0, 0, 0, RATES), r"memory_per_rank.*0"),
            (lambda: _cluster(allreduce="tree"), "tree"),
            (lambda: ComputeRates(0, {}), r"lookup_bytes_per_s.*0"),
            (lambda: ComputeRates(1e9, {"lamb": 1.0}), "lamb"),
            (lambda: ComputeRates(1e9, {"sgd": 1.0}, -1e-6), r"dense_seconds_per_sample"),
            (lambda: Workload(t, 0), r"local_batch_size.*0"),
            (lambda: Workload(t, 4, optimizer="lamb"), "lamb"),
            (lambda: Workload(t, 4, replica_sync="never"), "never"),
            (lambda: Workload(t, 4, comm_dtype="int8"), "int8"),
            (lambda: Workload(t, 4, unique_fraction=1.5), r"1\.5"),
            (lambda: Workload((), 4), "empty"),
            (lambda: plan_sharding(list(t), 1, 2, replica_sync="never"), "never"),
            (lambda: plan_sharding(list(t), 1, 2, sync_every=0), r"sync_every.*0"),
            (lambda: plan_sharding(list(t), 1, 2, strategy="cost"), "cluster"),
            (lambda: predict(plan_sharding(list(t), 1, 2), "model_major", _cluster(),
                             Workload(t, 4, optimizer="sgd")), r"2 ranks.*4"),
            (lambda: predict(plan_sharding(list(t), 2, 2), "diagonal", _cluster(),
                             Workload(t, 4, optimizer="sgd")), "diagonal"),
            (lambda: predict(plan_sharding(list(t), 2, 2), "model_major", _cluster(),
                             Workload((TableConfig("b", 10, 4),), 4)), "'a'"),
            (lambda: predict(plan_sharding(list(t), 2, 2), "model_major", _cluster(),
                             Workload(t, 4, optimizer="adam")), "adam"),   # no apply rate
        ]
        for fn, pattern in cases:
            with self.subTest(pattern=pattern):
                with self.assertRaisesRegex(ValueError, pattern):
                    fn()

    def test_doctests(self):
        # the planning package and its modules
        for module in (planning, plan_types, tiers, traffic, strategies, plan_cost_model,
                       cost_strategy, calibration, plan_planner):
            with self.subTest(module=module.__name__):
                self.assertEqual(doctest.testmod(module).failed, 0)

    def test_the_old_paths_warn_and_give_the_same_names(self):
        # in a fresh interpreter: a module warns once, when first imported
        import subprocess
        for old in ("planner", "cost_model"):
            code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
                    f"try:\n    import tfhybrid.{old}\nexcept DeprecationWarning as w:\n"
                    "    print(w)\n"
                    "warnings.simplefilter('ignore')\n"
                    f"import tfhybrid.{old} as o, tfhybrid.plan as p\n"
                    "print(all(getattr(o, n) is getattr(p, n) for n in p.__all__),"
                    " o.__all__ == p.__all__)")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                  text=True, check=True)
            self.assertEqual(done.stdout.splitlines(), [
                f"tfhybrid.{old} is deprecated: import the same names from tfhybrid.plan",
                "True True"], done.stderr)


class CalibrationTest(unittest.TestCase):

    def test_recovers_rates_from_model_points(self):
        tables = (TableConfig("a", 50_000, 16, hotness=4.0), TableConfig("b", 20_000, 16))
        work = Workload(tables, 128, dense_parameters=20_000)
        truth = ComputeRates(3e8, {"rowwise_adagrad": 2e8}, 0.0, 4e-3, 2e-4)
        template = _cluster(rates=ComputeRates(1e9, {"rowwise_adagrad": 1e9}, 0.0, 0.0, 0.0))
        points = []
        for bandwidth in (None, 3.1e7, 6.25e7, 1.25e8):
            for nodes, per_node, m, layout in ((2, 2, 4, "model_major"),
                                               (2, 2, 2, "model_major"),
                                               (2, 2, 2, "data_major"), (4, 1, 2, "model_major")):
                for sync, every, comm in (("gradients", 1, "float32"), ("weights", 4, "float16")):
                    point = dict(nodes=nodes, ranks_per_node=per_node,
                                 bandwidth_bytes_per_s=bandwidth, model_parallel=m,
                                 layout=layout, replica_sync=sync, sync_every=every,
                                 comm_dtype=comm, step_seconds=1.0)
                    plan, lay, cluster, w = calibration.point_setup(
                        point, replace_rates(template, truth), work)
                    point["step_seconds"] = predict(plan, lay, cluster, w).step_seconds
                    points.append(point)
        fitted = calibrate(points, template, work)
        rows = validate(points, replace_rates(template, fitted), work)
        self.assertEqual(len(rows), 32)
        for point, predicted, measured, ratio in rows:
            self.assertAlmostEqual(ratio, 1.0, places=6, msg=str(point))
        # the template's rates alone do not explain the points
        untrained = validate(points, template, work)
        self.assertTrue(any(abs(r[3] - 1) > 0.1 for r in untrained))
        with self.assertRaisesRegex(ValueError, "step_seconds"):
            calibrate([{"nodes": 1}, {"nodes": 2}], template, work)
        # rates measured by a microbenchmark stay as given; the rest are fitted around them
        known = replace_rates(template, ComputeRates(
            truth.lookup_bytes_per_s, {"rowwise_adagrad": 1e9}, truth.dense_seconds_per_sample,
            0.0, truth.collective_overhead_seconds))
        partly = calibrate(points, known, work, measured=(
            "lookup_bytes_per_s", "collective_overhead_seconds", "dense_seconds_per_sample"))
        self.assertEqual(partly.lookup_bytes_per_s, truth.lookup_bytes_per_s)
        self.assertEqual(partly.collective_overhead_seconds, truth.collective_overhead_seconds)
        self.assertAlmostEqual(partly.apply_rate("rowwise_adagrad") / 2e8, 1.0, places=6)
        self.assertAlmostEqual(partly.step_overhead_seconds, truth.step_overhead_seconds,
                               places=9)
        with self.assertRaisesRegex(ValueError, r"\['lookup_rate'\] are not rates"):
            calibrate(points, known, work, measured=("lookup_rate",))


def replace_rates(cluster: ClusterSpec, rates: ComputeRates) -> ClusterSpec:
    from dataclasses import replace
    return replace(cluster, rates=rates)


if __name__ == "__main__":
    unittest.main()
