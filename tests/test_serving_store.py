"""RedisStore.put_rows on a real Redis Cluster (3 masters, 1 replica each, password).

One cluster serves the module (about 3 s to start). Each test writes a table of its own,
so they share it without seeing each other's keys.
"""

import doctest
import time
import unittest

import numpy as np
import redis

from tfhybrid.serving import RedisStore, rows as rows_lib, wire
from tfhybrid.serving.rows import PRECISIONS, encode, encode_matrix, values_of
from tfhybrid.serving.store import WRITE_ROWS
from tfhybrid.serving.wire import KeptSockets
from tfhybrid.testing.redis_cluster import LocalRedisCluster

# ids whose block or row gains a digit, the largest and least an int64 holds (a dynamic
# table's keys are any int64), and negative ones whose block rounds down
EDGES = np.array([0, 9, 10, 63, 64, 99, 100, 639, 640, 999, 1000, 6399, 6400, 123456789,
                  2 ** 62, 2 ** 62 + 1, 2 ** 63 - 1, -1, -63, -64, -65, -10 ** 15,
                  -2 ** 63], np.int64)
# what the ACL user of the username test may run: what a store's writer needs
ACL_COMMANDS = ["+mset", "+mget", "+wait", "+ping", "+info", "+cluster|slots",
                "+config|get", "+command"]


class PutRowsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.cluster = LocalRedisCluster(masters=3, replicas=1)
        cls.addClassCleanup(cls.cluster.stop)
        cls.cluster.start()

    def _store(self, **kwargs) -> RedisStore:
        options = dict(password=self.cluster.password, key_prefix="put-rows")
        store = RedisStore(self.cluster.nodes, **{**options, **kwargs})
        self.addCleanup(store.close)
        return store

    def _check(self, store: RedisStore, table: str, ids: np.ndarray, values: np.ndarray,
               slice_index: int = 0) -> None:
        self.assertEqual(store.put_rows(table, ids, values, slice_index), len(ids))
        got = store.get(store.row_keys(table, ids, slice_index))
        self.assertEqual(got, values_of(values))

    def test_encode_is_encode_matrix_split_into_rows(self):
        rows = np.random.default_rng(0).normal(size=[5, 7]).astype(np.float32)
        for precision in PRECISIONS:
            matrix = encode_matrix(rows, precision)
            self.assertEqual(matrix.dtype, np.uint8)
            self.assertEqual(encode(rows, precision), [bytes(row) for row in matrix])

    def test_doctests(self):
        for module in (rows_lib, wire):
            with self.subTest(module=module.__name__):
                result = doctest.testmod(module)
                self.assertGreater(result.attempted, 0)
                self.assertEqual(result.failed, 0)

    def test_rows_read_back_exactly_for_every_precision_and_id_pattern(self):
        store = self._store()
        rng = np.random.default_rng(1)
        patterns = {"consecutive": np.arange(0, 700, dtype=np.int64),
                    "edges": EDGES,
                    "shuffled": rng.permutation(np.union1d(EDGES, np.arange(60, 70))),
                    "one": np.array([2 ** 40 + 5], np.int64)}
        for precision in PRECISIONS:
            for name, ids in patterns.items():
                for slice_index in (0, 2):
                    with self.subTest(precision=precision, ids=name, slice=slice_index):
                        rows = rng.normal(size=[len(ids), 5]).astype(np.float32)
                        self._check(store, f"l.{precision}", ids,
                                    encode_matrix(rows, precision), slice_index)
        self.assertEqual(store.put_rows("l.empty", [], np.zeros([0, 4], np.uint8)), 0)

    def test_a_call_of_more_rows_than_one_request_writes_them_all(self):
        ids = np.arange(7, 7 + WRITE_ROWS + 300, dtype=np.int64)
        values = np.arange(len(ids), dtype=np.uint32).view(np.uint8).reshape(-1, 4)
        self._check(self._store(), "l.large", ids, values)

    def test_a_rewrite_replaces_rows_and_an_acl_user_writes_too(self):
        for node in self.cluster.nodes:
            self.cluster.cli(node, "ACL", "SETUSER", "writer", "on", ">writer-pw",
                             "~put-rows/*", "-@all", *ACL_COMMANDS)
        store = self._store(username="writer", password="writer-pw")
        ids = np.arange(5000, 5300, dtype=np.int64)
        self._check(store, "l.acl", ids, np.full([len(ids), 3], 1, np.uint8))
        self._check(store, "l.acl", ids, np.full([len(ids), 3], 2, np.uint8))

    def test_replicas_hold_the_rows_when_put_rows_returns(self):
        store = self._store()
        ids = np.arange(20000, 21000, dtype=np.int64)
        values = encode_matrix(np.random.default_rng(2).normal(size=[len(ids), 4]),
                               "float16")
        store.put_rows("l.replicated", ids, values)
        keys = store.row_keys("l.replicated", ids)
        masters = set(self.cluster.masters())
        found = {}
        for node in self.cluster.alive():
            if node in masters:
                continue
            host, port = node.rsplit(":", 1)
            replica = redis.Redis(host, int(port), password=self.cluster.password)
            self.addCleanup(replica.close)
            replica.execute_command("READONLY")
            for key, value in zip(keys, values_of(values)):
                try:
                    found[key] = (replica.get(key), value)
                except redis.exceptions.MovedError:
                    pass    # a key of another master's slot
        self.assertEqual(len(found), len(keys))
        self.assertTrue(all(got == want for got, want in found.values()))

    def test_kept_sockets_write_what_masters_acknowledge_and_report_the_rest(self):
        store = self._store()
        client = store.client()
        nodes = sorted(client.get_primaries(), key=lambda node: node.name)
        ids = np.arange(64 * 40, dtype=np.int64)
        slots = store.row_slots("l.sockets", ids)
        owner = {node.name: n for n, node in enumerate(nodes)}
        owners = np.array([owner[client.nodes_manager.get_node_from_slot(s).name]
                           for s in slots.tolist()], np.int64)
        values = np.arange(len(ids) * 2, dtype=np.uint16).view(np.uint8).reshape(-1, 4)
        keys = store.row_keys("l.sockets", ids)
        sockets = KeptSockets(None, self.cluster.password)
        self.addCleanup(sockets.reset)
        for wrong in (1, 0):
            # owners shifted by one: every master answers MOVED, so nothing counts
            written = np.zeros(len(ids), bool)
            self.assertTrue(sockets.attempt(
                sockets.put, nodes, (owners + wrong) % len(nodes), slots, keys, values,
                [1] * len(nodes), 5000, time.monotonic() + 10, written))
            self.assertEqual(written.all(), not wrong)
            self.assertEqual(written.any(), not wrong)
        self.assertEqual(store.get(store.row_keys("l.sockets", ids)), values_of(values))

    def test_a_slot_moved_since_the_store_read_the_topology_is_written_anyway(self):
        store = self._store()
        table = "l.moved"
        ids = np.arange(64 * 30, dtype=np.int64)
        store.put_rows(table, ids[:64], np.zeros([64, 2], np.uint8))   # topology read
        client = store.client()
        # an empty slot of this table, given to another master behind the store's back
        slot = int(store.row_slots(table, [64 * 29])[0])
        source = client.nodes_manager.get_node_from_slot(slot)
        target = next(n for n in client.get_primaries() if n.name != source.name)
        ids_of = {n.name: self.cluster.cli(n.name, "CLUSTER", "MYID").strip()
                  for n in (source, target)}
        # the steps of a resharding, so the target's claim wins (a new config epoch)
        self.cluster.cli(target.name, "CLUSTER", "SETSLOT", str(slot), "IMPORTING",
                         ids_of[source.name])
        self.cluster.cli(source.name, "CLUSTER", "SETSLOT", str(slot), "MIGRATING",
                         ids_of[target.name])
        others = [n.name for n in client.get_primaries()
                  if n.name not in (target.name, source.name)]
        for node in [target.name, source.name] + others:
            self.cluster.cli(node, "CLUSTER", "SETSLOT", str(slot), "NODE",
                             ids_of[target.name])
        moved_before = self._moved_errors(source.name)
        values = np.arange(len(ids) * 3, dtype=np.int64).astype(np.uint8).reshape(-1, 3)
        self._check(store, table, ids, values)
        # the store's own sockets met MOVED there, and redis-py wrote the rest
        self.assertGreater(self._moved_errors(source.name), moved_before)
        self.cluster.wait_healthy(30)

    def _moved_errors(self, node: str) -> int:
        stats = self.cluster.info(node, "errorstats").get("errorstat_MOVED", "count=0")
        return int(stats.split("=")[1].split(",")[0])

    def test_bad_arguments_raise_value_error_naming_them(self):
        store = self._store()
        for ids, values, named in [
                (np.array([2 ** 63], np.uint64), np.zeros([1, 4], np.uint8), str(2 ** 63)),
                (np.array([0.5]), np.zeros([1, 4], np.uint8), "float64"),
                (np.array([1, 2]), np.zeros([1, 4], np.uint8), "[1, 4]"),
                (np.array([1]), np.zeros([1, 4], np.float32), "float32")]:
            with self.assertRaisesRegex(ValueError, named.replace("[", r"\[")):
                store.put_rows("l.bad", ids, values)


if __name__ == "__main__":
    unittest.main()
