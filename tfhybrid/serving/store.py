"""``RedisStore``: the Redis Cluster that holds served tables, one connection object.

The export, the delta publisher and the predictor each take one. Every read and write
groups its keys by the master that serves their slot and sends one pipelined request per
master, the masters in parallel (a thread each), so a request costs one round trip per
node, not one per key: keys of one slot go in one ``MGET`` or ``MSET`` (commands packed
by hand, replies read in order). A request's read (up to ``PIPELINE_KEYS`` keys), and a
write of whole rows (``put_rows``: an export's millions), go over a plain socket per
master kept open, all from the calling thread, their requests built with NumPy and
replies parsed by hiredis (``tfhybrid.serving.wire``; not over TLS); anything unusual on
them (a failover, a moved slot) sends that part the redis-py way, which follows the
cluster. A write ends, in the same pipeline, with
``WAIT`` for the master's replicas: a write counts once its replicas hold it, so a
failover loses none of it. Every call has a deadline; a node that does not answer within
it is an error that names the node, and a key that is absent comes back as ``None`` for
the caller to name.

Keys: ``{key_prefix}/{{table}/{slice}/{block}}/{row}`` for a row (or a column slice of
it), whose hash tag puts each block of ``BLOCK_ROWS`` rows in one slot, and
``{key_prefix}/meta/{table}`` for a table's metadata (JSON). ``table`` is the layer and
table name, ``"{layer}.{table}"``.

redis-py is imported when a store is connected; NumPy and the standard library otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from binascii import crc_hqx
from typing import Any, Callable, Sequence

import numpy as np

from tfhybrid.serving.rows import values_of
from tfhybrid.serving.wire import (BLOCK_ROWS, RUN_KEYS, SLOTS, KeptSockets, RowKeys,
                                   packed)

# the cluster setting a store needs: an evicted row must never read as a valid one
REQUIRED_POLICY = "noeviction"
# keys per pipelined request: large enough to amortize a round trip, small enough that
# one request's replies stay a few MB
PIPELINE_KEYS = 4096
# rows of one request of put_rows at most: the request, built whole before it is sent
# (about the rows' bytes and twice their keys'), stays some MB
WRITE_ROWS = 1 << 16
# blocks of a table (slice) whose slots a store keeps (2 bytes each): a request's keys need
# no CRC each for tables of up to 4M rows
CACHED_BLOCKS = 1 << 16


class StoreUnavailable(TimeoutError):
    """A node of the cluster did not answer within the deadline (its name in the message)."""


def parse_nodes(nodes: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (or a list of ``"host:port"``) as (host, port) pairs.

    >>> parse_nodes("10.0.0.1:7000,10.0.0.2:7001")
    [('10.0.0.1', 7000), ('10.0.0.2', 7001)]
    """
    items = [n.strip() for n in (nodes.split(",") if isinstance(nodes, str) else nodes)]
    if not items or not all(items):
        raise ValueError(f"nodes={nodes!r} must name at least one host:port")
    pairs = []
    for item in items:
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"nodes: {item!r} is not host:port")
        pairs.append((host, int(port)))
    return pairs


def _runs(indices: list[int], slots: np.ndarray, most: int = RUN_KEYS) -> list[list[int]]:
    """``indices`` (sorted by slot) cut where the slot changes, at most ``most`` each."""
    if not len(indices):
        return []
    at = np.asarray(indices, np.int64)
    of = slots[at]
    starts = np.flatnonzero(np.concatenate([[True], of[1:] != of[:-1]])).tolist()
    ends = starts[1:] + [len(at)]
    return [indices[c:min(b, c + most)] for a, b in zip(starts, ends)
            for c in range(a, b, most)]


def _chunked(commands: list[bytes], runs: list[list[int]]) -> list[list[bytes]]:
    """The commands (one per run of keys) in chunks of about ``PIPELINE_KEYS`` keys, one
    round trip each."""
    sizes = [len(run) for run in runs]
    chunks: list[list[bytes]] = [[]]
    held = 0
    for command, size in zip(commands, sizes):
        if held and held + size > PIPELINE_KEYS:
            chunks.append([])
            held = 0
        chunks[-1].append(command)
        held += size
    return chunks


def _completed(per_node: Callable[..., Any], *args: Any) -> list:
    """``per_node``'s results in a thread: read now where it returned a reader."""
    result = per_node(*args)
    return result() if callable(result) else result


def _send(client: Any, chunks: list[list[bytes]], last: bytes | None, deadline: float
          ) -> Callable[[], list]:
    """Sends chunks of packed commands (and ``last`` after the final one) on one
    connection of ``client`` (a node's ``redis.Redis``); returns the function that reads
    their replies in order (each read bounded by ``deadline``, a ``time.monotonic()``).
    One chunk goes out now; a later chunk once the one before it is read (one round trip
    each, so replies never pile up past a chunk).

    A redis-py pipeline spends several times the round trip building and parsing an
    object per command (12 of the 14 ms of a 1600-key read over 3 nodes here). An error
    reply is read whole, so the rest of the replies stay in step, then raised.
    """
    from redis import exceptions

    pool = client.connection_pool
    connection = pool.get_connection()

    def packed(n: int) -> list[bytes]:
        return chunks[n] + ([last] if last is not None and n == len(chunks) - 1 else [])

    try:
        connection.send_packed_command([b"".join(packed(0))])
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise

    def read() -> list:
        try:
            replies: list = []
            error = None
            for n in range(len(chunks)):
                if n:
                    connection.send_packed_command([b"".join(packed(n))])
                for _ in packed(n):
                    try:
                        replies.append(connection.read_response(
                            timeout=max(0.001, deadline - time.monotonic())))
                    except exceptions.ResponseError as e:
                        error = error or e
                        replies.append(None)
                if error is not None:
                    raise error
            return replies
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    return read


class RedisStore:
    """A Redis Cluster reached as ``username`` / ``password``, over TLS with ``ssl``.

    Args:
      nodes: some of the cluster's nodes, ``"host:port,..."`` or a list; the client
        discovers the rest.
      username, password: an ACL user (``None``: the default user) and its password.
      ssl: TLS; ``ssl_ca_certs`` names the CA file that signed the nodes' certificates.
      key_prefix: the first part of every key, so several models share a cluster.
      timeout_s: a call's default deadline (connect, send, every node's answer).

    Example (needs a running cluster; the one of ``tfhybrid.testing.redis_cluster``)::

        import numpy as np
        from tfhybrid.serving import RedisStore
        from tfhybrid.testing.redis_cluster import LocalRedisCluster
        with LocalRedisCluster() as cluster:
            store = RedisStore(cluster.nodes, password=cluster.password)
            assert store.check_settings()["maxmemory-policy"] == "noeviction"
            store.put([b"k1", b"k2"], [b"a", b"b"])
            assert store.get([b"k2", b"k1", b"nope"]) == [b"b", b"a", None]
            store.put_rows("layer.table", [7, 70], np.array([[1, 2], [3, 4]], np.uint8))
            assert store.get(store.row_keys("layer.table", [70])) == [b"\\x03\\x04"]
            store.close()
    """

    def __init__(self, nodes: str | Sequence[str], username: str | None = None,
                 password: str | None = None, ssl: bool = False,
                 key_prefix: str = "tfhybrid", timeout_s: float = 10.0,
                 ssl_ca_certs: str | None = None):
        self.nodes = [f"{h}:{p}" for h, p in parse_nodes(nodes)]
        if not key_prefix or "/" in key_prefix:
            raise ValueError(f"key_prefix={key_prefix!r} must be non-empty without '/'")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        self.username = username
        self.ssl = bool(ssl)
        self.ssl_ca_certs = ssl_ca_certs
        self.key_prefix = key_prefix
        self.timeout_s = float(timeout_s)
        self._password = password
        self._client: Any = None
        self._slot_nodes: list[Any] = []
        self._owner_nodes: list[Any] = []
        self._slot_owner = np.zeros([SLOTS], np.int64)
        self._replica_counts: dict[str, int] = {}
        self._block_slots: dict[bytes, np.ndarray] = {}
        self._slot_spaces: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        # reads and writes each on sockets of their own: neither waits for the other
        self._fast = KeptSockets(username, password)
        self._fast_writes = KeptSockets(username, password)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16,
                                                           thread_name_prefix="redis-store")

    # ------------------------------------------------------------------ keys
    def row_key(self, table: str, row: int, slice_index: int = 0) -> bytes:
        """The key of row ``row`` (slice ``slice_index``) of table ``table``."""
        return self.row_keys(table, [row], slice_index)[0]

    def row_keys(self, table: str, rows: Any, slice_index: int = 0) -> RowKeys:
        """:meth:`row_key` of every row of ``rows`` (ints): ``{prefix}/{table/slice/b}/row``,
        whose hash tag, the block b = row // ``BLOCK_ROWS``, puts a block's rows in one
        slot, so that a write sends one ``MSET`` per block (``wire.RowKeys``: a sequence
        of the keys, framed at once by a request)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        return self.tables_row_keys([table], np.zeros(len(rows), np.int64), rows, slice_index)

    def tables_row_keys(self, tables: Sequence[str], which: Any, rows: Any,
                        slice_index: int = 0) -> RowKeys:
        """:meth:`row_keys` of rows of several tables: row ``rows[i]`` of table
        ``tables[which[i]]``."""
        return RowKeys([self._row_key_head(table, slice_index) for table in tables],
                       which, rows)

    def _row_key_head(self, table: str, slice_index: int) -> bytes:
        """What the keys of a table (slice)'s rows begin with, up to the block."""
        return f"{self.key_prefix}/{{{table}/{slice_index}/".encode()

    def row_slots(self, table: str, rows: Any, slice_index: int = 0) -> np.ndarray:
        """The hash slot of each of :meth:`row_keys` (one CRC per block, not per row)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        return self.tables_row_slots([table], np.zeros(len(rows), np.int64), rows,
                                     slice_index)

    def tables_row_slots(self, tables: Sequence[str], which: Any, rows: Any,
                         slice_index: int = 0) -> np.ndarray:
        """:meth:`row_slots` of :meth:`tables_row_keys`: looked up where every table's
        blocks are among its first ``CACHED_BLOCKS``, whose slots the store keeps."""
        which = np.asarray(which, np.int64).reshape(-1)
        blocks = np.asarray(rows, np.int64).reshape(-1) // BLOCK_ROWS
        tags = [f"{table}/{slice_index}/".encode() for table in tables]
        if not blocks.size:
            return np.zeros([0], np.int64)
        name = tuple(tags)
        space = self._slot_spaces.get(name)
        if space is None or not (blocks < space[1][which]).all():
            tops = np.zeros(len(tags), np.int64)
            np.maximum.at(tops, which, blocks + 1)
            if int(tops.max()) > CACHED_BLOCKS:
                space = None
            else:
                known = [self._block_slots_of(tag, int(top)) for tag, top in zip(tags, tops)]
                sizes = np.array([len(k) for k in known], np.int64)
                space = (np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64),
                         sizes, np.concatenate(known))
                self._slot_spaces[name] = space
        if space is not None and int(blocks.min()) >= 0:
            return space[2][space[0][which] + blocks].astype(np.int64)
        pairs, where = np.unique(np.stack([which, blocks], axis=1), axis=0,
                                 return_inverse=True)
        slots = np.array([crc_hqx(tags[t] + b"%d" % b, 0) & (SLOTS - 1)
                          for t, b in pairs.tolist()], np.int64)
        return slots[where.reshape(-1)]

    def _block_slots_of(self, tag: bytes, top: int) -> np.ndarray:
        """The slots of blocks 0 .. at least ``top`` - 1 of the table (slice) ``tag``."""
        known = self._block_slots.get(tag)
        if known is None or len(known) < top:
            grown = 2 * len(known) if known is not None else 0
            size = min(CACHED_BLOCKS, max(top, 1024, grown))
            known = self._block_slots[tag] = np.array(
                [crc_hqx(tag + b"%d" % b, 0) & (SLOTS - 1) for b in range(size)], np.uint16)
        return known

    def meta_key(self, table: str) -> bytes:
        """The key of table ``table``'s metadata."""
        return f"{self.key_prefix}/meta/{table}".encode()

    # ------------------------------------------------------------------ client
    def client(self) -> Any:
        """The ``redis.cluster.RedisCluster`` client, connected on first use."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
                self._refresh_slots()
            return self._client

    def _connect(self) -> Any:
        from redis import exceptions
        from redis.cluster import ClusterNode, RedisCluster

        options: dict[str, Any] = dict(
            startup_nodes=[ClusterNode(h, p) for h, p in parse_nodes(self.nodes)],
            username=self.username, password=self._password,
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            require_full_coverage=True)
        if self.ssl:
            options.update(ssl=True, ssl_ca_certs=self.ssl_ca_certs)
        try:
            return RedisCluster(**options)
        except exceptions.AuthenticationError as e:
            raise PermissionError(
                f"RedisStore: the cluster at {','.join(self.nodes)} refused user "
                f"{self.username or 'default'!r} with the password given: {e}") from e
        except exceptions.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise PermissionError(
                    f"RedisStore: the cluster at {','.join(self.nodes)} needs a password "
                    f"for user {self.username or 'default'!r}: {e}") from e
            raise
        except (exceptions.ConnectionError, exceptions.RedisClusterException) as e:
            if any(word in str(e).upper() for word in ("AUTH", "PASSWORD")):
                raise PermissionError(
                    f"RedisStore: the cluster at {','.join(self.nodes)} refused user "
                    f"{self.username or 'default'!r}: {e}") from e
            raise StoreUnavailable(f"RedisStore: no node of {','.join(self.nodes)} "
                                   f"answered within {self.timeout_s} s: {e}") from e

    def _refresh_slots(self) -> None:
        """Reads which master serves each slot (after a failover, say)."""
        manager = self._client.nodes_manager
        manager.initialize()
        self._slot_nodes = [manager.get_node_from_slot(s) for s in range(SLOTS)]
        names = sorted({n.name for n in self._slot_nodes})
        self._owner_nodes = [next(n for n in self._slot_nodes if n.name == name)
                             for name in names]
        self._slot_owner = np.array([names.index(n.name) for n in self._slot_nodes], np.int64)
        # the replicas a write waits for: those connected to its master now (a dead
        # one is not waited for; a failover's new master has one replica fewer)
        counts: dict[str, int] = {}
        for node in {n.name: n for n in self._slot_nodes}.values():
            info = self._client.get_redis_connection(node).info("replication")
            counts[node.name] = int(info.get("connected_slaves", 0))
        self._replica_counts = counts

    def refresh(self) -> None:
        """Reads the cluster's topology again (the calls do it after an error)."""
        self._fast.reset()
        self._fast_writes.reset()
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            self._refresh_slots()

    def check_settings(self) -> dict[str, Any]:
        """What every master reports for the settings that matter; ValueError naming a
        master whose ``maxmemory-policy`` is not ``noeviction`` (an evicted row would
        read as missing, a served model silently wrong)."""
        client = self.client()
        found: dict[str, Any] = {"masters": [], "maxmemory-policy": None, "replicas": {}}
        for node in client.get_primaries():
            policy = client.get_redis_connection(node).config_get(
                "maxmemory-policy").get("maxmemory-policy")
            found["masters"].append(node.name)
            found["replicas"][node.name] = self._replicas_of(node)
            if policy != REQUIRED_POLICY:
                raise ValueError(
                    f"RedisStore: master {node.name} has maxmemory-policy={policy!r}; "
                    f"served tables need {REQUIRED_POLICY!r} (an evicted row must never "
                    "read as a valid one). Set it with CONFIG SET maxmemory-policy "
                    "noeviction on every node (and in redis.conf).")
            found["maxmemory-policy"] = policy
        return found

    def _replicas_of(self, node: Any) -> int:
        return self._replica_counts.get(node.name, 0)

    # ------------------------------------------------------------------ calls
    def _groups(self, keys: Sequence[bytes], slots: np.ndarray
                ) -> dict[str, tuple[Any, list[int]]]:
        """{node name: (node, indices of its keys, sorted by slot)}."""
        owners = self._slot_owner[slots]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for n in np.unique(owners).tolist():
            node = self._owner_nodes[n]
            mine = np.flatnonzero(owners == n)
            groups[node.name] = (node, mine[np.argsort(slots[mine], kind="stable")].tolist())
        return groups

    @staticmethod
    def slots_of(keys: Sequence[bytes]) -> np.ndarray:
        """Each key's hash slot (CRC16 of its ``{hash tag}`` where it has one), as
        redis-py's ``key_slot`` computes it; in one C pass for keys without a tag."""
        from redis.crc import key_slot

        return np.fromiter((key_slot(k) if b"{" in k else crc_hqx(k, 0) & (SLOTS - 1)
                            for k in keys), np.int64, len(keys))

    def _run(self, keys: Sequence[bytes], per_node: Callable[..., Any],
             deadline_s: float | None, what: str, slots: np.ndarray,
             fan_out: bool = False) -> list:
        """Runs ``per_node(connection, node, indices, deadline)`` for every master's keys,
        retrying (topology read again) until the deadline on a moved slot or a node that
        does not answer; the results by key index. The masters run in parallel: each in
        a thread, or with ``fan_out`` (small requests) in this one: ``per_node`` sends and
        returns a function that reads the replies, so every master's request is on the
        wire before any reply is read."""
        self.client()
        deadline = time.monotonic() + (self.timeout_s if deadline_s is None else deadline_s)
        results: list = [None] * len(keys)
        pending = list(range(len(keys)))
        last_error: dict[str, str] = {}
        while pending:
            pending_at = np.asarray(pending, np.int64)
            groups = self._groups([keys[i] for i in pending], slots[pending_at])
            outcomes: dict[str, tuple[list[int], Any]] = {}
            if fan_out:
                reads = {}
                for name, (node, local) in groups.items():
                    indices = pending_at[local].tolist()
                    try:
                        reads[name] = (indices, per_node(
                            self._client.get_redis_connection(node), node, indices, deadline))
                    except Exception as e:  # classified below, with the others
                        outcomes[name] = (indices, e)
                for name, (indices, read) in reads.items():
                    try:
                        outcomes[name] = (indices, read())
                    except Exception as e:
                        outcomes[name] = (indices, e)
            else:
                futures = {self._pool.submit(
                    _completed, per_node, self._client.get_redis_connection(node), node,
                    pending_at[local].tolist(), deadline): (name, pending_at[local].tolist())
                    for name, (node, local) in groups.items()}
                done, not_done = concurrent.futures.wait(
                    futures, timeout=max(0.0, deadline - time.monotonic()))
                for future in done:
                    name, indices = futures[future]
                    error = future.exception()
                    outcomes[name] = (indices, error if error is not None else future.result())
                for future in not_done:
                    name, indices = futures[future]
                    outcomes[name] = (indices, TimeoutError(
                        f"no answer within {deadline_s or self.timeout_s} s"))
            failed: list[int] = []
            for name, (indices, outcome) in outcomes.items():
                if isinstance(outcome, BaseException):
                    self._classify(outcome, name, what)
                    last_error[name] = f"{type(outcome).__name__}: {outcome}"
                    failed.extend(indices)
                else:
                    for i, value in zip(indices, outcome):
                        results[i] = value
            if not failed:
                break
            if time.monotonic() >= deadline:
                raise StoreUnavailable(
                    f"RedisStore {what}: {len(failed)} keys not served within the deadline; "
                    + "; ".join(f"node {n}: {err}" for n, err in sorted(last_error.items())))
            pending = sorted(failed)
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            try:
                self.refresh()
            except Exception as e:  # a node of the old topology may be the dead one
                last_error["topology"] = f"{type(e).__name__}: {e}"
        return results

    def _classify(self, error: BaseException, name: str, what: str) -> None:
        """Returns for an error worth a retry (the cluster is moving: a failover, a
        resharding, a node not answering); raises the others, naming the node."""
        from redis import exceptions

        if isinstance(error, (exceptions.AuthenticationError, exceptions.NoPermissionError)):
            raise PermissionError(f"RedisStore {what}: node {name} refused user "
                                  f"{self.username or 'default'!r}: {error}") from error
        if isinstance(error, (exceptions.ConnectionError, exceptions.TimeoutError,
                              exceptions.ClusterDownError, exceptions.MovedError,
                              exceptions.TryAgainError, exceptions.AskError,
                              exceptions.BusyLoadingError, exceptions.ReadOnlyError,
                              OSError)):
            return
        if isinstance(error, exceptions.ResponseError):
            raise RuntimeError(f"RedisStore {what}: node {name} answered {error}") from error
        raise error

    def get(self, keys: Sequence[bytes], deadline_s: float | None = None,
            slots: np.ndarray | None = None) -> list:
        """The values of ``keys`` (``None`` where a key is absent), one pipelined request
        per master (an ``MGET`` per slot), the masters in parallel; StoreUnavailable
        naming a node that does not answer within ``deadline_s`` (default ``timeout_s``).
        ``slots``: the keys' slots if known (:meth:`row_slots`)."""
        slots = self.slots_of(keys) if slots is None else np.asarray(slots, np.int64)
        if len(keys) and len(keys) <= PIPELINE_KEYS and not self.ssl:
            self.client()
            deadline = time.monotonic() + (
                self.timeout_s if deadline_s is None else deadline_s)
            values = self._fast.attempt(self._fast.get, self._owner_nodes,
                                        self._slot_owner[slots], keys, slots, deadline)
            if values is not None:
                return values
            deadline_s = max(0.0, deadline - time.monotonic())

        def per_node(client: Any, node: Any, indices: list[int], deadline: float) -> Any:
            runs = _runs(indices, slots)
            commands = [packed(b"MGET", [keys[i] for i in run]) for run in runs]
            read = _send(client, _chunked(commands, runs), None, deadline)
            return lambda: [value for reply in read() for value in reply]

        # a large read goes out chunk by chunk, each master in a thread; a request's few
        # thousand keys fan out from this thread, every master's request sent first
        return self._run(keys, per_node, deadline_s, "get", slots,
                         fan_out=len(keys) <= PIPELINE_KEYS)

    def put(self, keys: Sequence[bytes], values: Sequence[bytes],
            deadline_s: float | None = None, slots: np.ndarray | None = None) -> int:
        """Writes each key's whole value, one pipelined request per master (an ``MSET``
        per slot, in chunks of about ``PIPELINE_KEYS`` keys), the masters in parallel,
        each ending with ``WAIT`` for that master's replicas; RuntimeError naming a master
        whose replicas did not acknowledge. Returns the number of keys written."""
        if len(keys) != len(values):
            raise ValueError(f"put got {len(keys)} keys and {len(values)} values")
        self._write(b"MSET", keys, values, deadline_s, slots)
        return len(keys)

    def put_rows(self, table: str, rows: Any, values: np.ndarray, slice_index: int = 0,
                 deadline_s: float | None = None) -> int:
        """Writes ``values[i]`` (uint8 [n, value bytes], :func:`rows.encode_matrix`) under
        :meth:`row_key` of ``rows[i]`` (int64, any order), as :meth:`put` does: an
        ``MSET`` per slot, each master's request ending with ``WAIT`` for its replicas,
        within ``deadline_s``. Returns the number of rows written.

        An export writes millions of rows: their request is built at once with NumPy and
        sent over plain sockets kept open (``tfhybrid.serving.wire``), every master's at
        once from this thread, where :meth:`put` spent more CPU per row than the Redis
        servers. Rows of a master that answered anything unusual (``MOVED``, a closed
        socket, too few replicas, the deadline), and every row over TLS, are written again
        by :meth:`put`, which follows the cluster and names a node at fault (an ``MSET``
        repeated writes the same).
        """
        rows, values = np.asarray(rows).reshape(-1), np.asarray(values)
        if rows.dtype.kind not in "iu" and rows.size:
            raise ValueError(f"put_rows: rows must be int64, not {rows.dtype}")
        if rows.dtype == np.uint64 and len(rows) and int(rows.max()) >= 2 ** 63:
            raise ValueError(f"put_rows: row {int(rows.max())} is not an int64")
        rows = rows.astype(np.int64)
        if values.dtype != np.uint8 or values.shape[:1] != rows.shape or values.ndim != 2:
            raise ValueError(f"put_rows: values must be uint8 [{len(rows)}, value bytes], "
                             f"got {values.dtype} {list(values.shape)}")
        timeout_s = self.timeout_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + timeout_s
        slots = self.row_slots(table, rows, slice_index)
        written = np.zeros(len(rows), bool)
        keys = self.row_keys(table, rows, slice_index)
        if len(rows) and not self.ssl:
            self.client()
            replicas = [self._replicas_of(node) for node in self._owner_nodes]
            for first in range(0, len(rows), WRITE_ROWS):
                part = slice(first, first + WRITE_ROWS)
                self._fast_writes.attempt(
                    self._fast_writes.put, self._owner_nodes,
                    self._slot_owner[slots[part]], slots[part],
                    RowKeys(keys.heads, keys.which[part], keys.rows[part]),
                    np.ascontiguousarray(values[part]), replicas,
                    max(1, int(timeout_s * 1000)), deadline, written[part])
        left = np.flatnonzero(~written)
        if len(left):
            self.put(RowKeys(keys.heads, keys.which[left], keys.rows[left]),
                     values_of(values[left]), max(0.0, deadline - time.monotonic()),
                     slots[left])
        return len(rows)

    def _write(self, command: bytes, keys: Sequence[bytes], values: Sequence[bytes] | None,
               deadline_s: float | None, slots: np.ndarray | None) -> int:
        """``command`` (``MSET`` with ``values``, or ``DEL``) per slot of ``keys``, one
        pipelined request per master ending with ``WAIT``; the commands' integer replies
        summed (``MSET``'s ``OK`` counts 0)."""
        timeout_s = self.timeout_s if deadline_s is None else deadline_s
        slots = self.slots_of(keys) if slots is None else np.asarray(slots, np.int64)

        def per_node(client: Any, node: Any, indices: list[int], deadline: float) -> list:
            # WAIT last on the same connection, which is what WAIT counts the writes of
            replicas = self._replicas_of(node)
            runs = _runs(indices, slots)
            if values is None:
                commands = [packed(command, [keys[i] for i in run]) for run in runs]
            else:
                commands = [packed(command, [kv for i in run for kv in (keys[i], values[i])])
                            for run in runs]
            wait = packed(b"WAIT", [b"%d" % replicas, b"%d" % int(timeout_s * 1000)])
            replies = _send(client, _chunked(commands, runs), wait if replicas else None,
                            deadline)()
            if replicas and int(replies[-1]) < replicas:
                raise RuntimeError(
                    f"RedisStore {command.decode().lower()}: {replies[-1]} of master "
                    f"{node.name}'s {replicas} replicas acknowledged the writes within "
                    f"{timeout_s} s")
            counts = [r if isinstance(r, int) else 0 for r in replies[:len(commands)]]
            # one result per key: the count of its run on the run's first key
            out = [0] * len(indices)
            at = 0
            for run, n in zip(runs, counts):
                out[at] = n
                at += len(run)
            return out

        return sum(self._run(keys, per_node, deadline_s, command.decode().lower(), slots))

    def delete(self, keys: Sequence[bytes], deadline_s: float | None = None,
               slots: np.ndarray | None = None) -> int:
        """Deletes ``keys`` (absent ones are no error) as :meth:`put` writes: a ``DEL`` per
        slot, one pipelined request per master ending with ``WAIT``. Returns the number of
        keys that were there."""
        return self._write(b"DEL", keys, None, deadline_s, slots)

    def put_json(self, key: bytes, value: Any, deadline_s: float | None = None) -> None:
        """Writes ``value`` as JSON under ``key`` (metadata), replicas acknowledged."""
        self.put([key], [json.dumps(value, sort_keys=True).encode()], deadline_s)

    def get_json(self, key: bytes, deadline_s: float | None = None) -> Any:
        """The JSON under ``key``, or None if it is absent."""
        value = self.get([key], deadline_s)[0]
        return None if value is None else json.loads(value)

    def close(self) -> None:
        """Closes the connections (the store reconnects on next use)."""
        self._fast.reset()
        self._fast_writes.reset()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __repr__(self) -> str:
        return (f"RedisStore(nodes={','.join(self.nodes)!r}, username={self.username!r}, "
                f"ssl={self.ssl}, key_prefix={self.key_prefix!r})")
