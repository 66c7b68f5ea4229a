"""Redis requests without redis-py's Python work per key: RESP built with NumPy, sent on
plain sockets kept open per master, replies parsed by hiredis.

``RedisStore`` (``tfhybrid.serving.store``) sends a read of up to ``PIPELINE_KEYS`` keys,
and every write of whole rows (an export's millions), this way: redis-py spends more CPU
per key building, sending and parsing than the Redis servers spend on it. Anything
unusual (an error reply such as ``MOVED``, a closed socket, the deadline) is reported,
not handled: the store then sends that part by redis-py, which follows the cluster and
names the node at fault.

Example::

    import numpy as np
    from tfhybrid.serving.wire import RowKeys, mset_payload, packed
    assert packed(b"GET", [b"k"]) == b"*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n"
    one = mset_payload(RowKeys([b"p/{t/0/"], [0], [5]), np.array([0]),
                       np.zeros([1, 2], np.uint8), np.array([True]))
    assert bytes(one).split(b"\\r\\n") == [b"*3", b"$4", b"MSET", b"$11", b"p/{t/0/0}/5",
                                         b"$2", b"\\0\\0", b""]
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

# the Redis Cluster's hash slots
SLOTS = 16384
# keys of one slot per MSET or MGET at most: a command the server parses in one go
RUN_KEYS = 512
# rows of a table (slice) that share a hash slot: a write of a shard sends one MSET per
# block of them; reads of random ids still spread over every node
BLOCK_ROWS = 64


def packed(command: bytes, arguments: Sequence[bytes]) -> bytes:
    """One command in the protocol's form (RESP), ready to send.

    >>> packed(b"GET", [b"k"])
    b'*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n'
    """
    return b"*%d\r\n$%d\r\n%s\r\n" % (len(arguments) + 1, len(command), command) + b"".join(
        b"$%d\r\n%s\r\n" % (len(a), a) for a in arguments)


def decimal_digits(numbers: np.ndarray, where: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(ASCII digits, kept) of ``numbers`` (ints >= 0): uint8 [n, w] right-aligned in as
    many columns as the largest has digits, and bool [n, w], True on a number's own digits
    (on none of a row where ``where`` is False).

    >>> digits, kept = decimal_digits(np.array([7, 120]))
    >>> [bytes(d[k]) for d, k in zip(digits, kept)]
    [b'7', b'120']
    """
    width = len(str(int(numbers.max()))) if len(numbers) else 1
    digits = np.empty([len(numbers), width], np.uint8)
    rest = numbers
    for column in range(width - 1, -1, -1):
        rest, digits[:, column] = np.divmod(rest, 10)
    digits += ord("0")
    counts = np.ones(len(numbers), np.int64)
    for power in range(1, width):
        counts += numbers >= 10 ** power
    kept = np.arange(width) >= (width - counts)[:, None]
    return digits, kept if where is None else kept & where[:, None]


class RowKeys:
    """The keys of rows of several tables, kept as numbers: row ``rows[i]`` of the table
    whose keys begin ``heads[which[i]]`` has key ``heads[which[i]] + b"%d}/%d" %
    (rows[i] // BLOCK_ROWS, rows[i])`` (a block's rows share the hash tag, so a slot).
    A write frames them all at once with NumPy (:func:`mset_payload`), a read in one
    pass (:meth:`mget_records`); one key is built alone only where it is read alone
    (``keys[i]``: an error message, redis-py).

    Example::

        import numpy as np
        from tfhybrid.serving.wire import RowKeys
        keys = RowKeys([b"p/{a/0/", b"p/{b/1/"], np.array([0, 1]), np.array([5, -70]))
        assert list(keys) == [b"p/{a/0/0}/5", b"p/{b/1/-2}/-70"]
    """

    def __init__(self, heads: Sequence[bytes], which: Any, rows: Any):
        self.heads = list(heads)
        self.which = np.asarray(which, np.int64).reshape(-1)
        self.rows = np.asarray(rows, np.int64).reshape(-1)
        if self.which.shape != self.rows.shape:
            raise ValueError(f"RowKeys: {len(self.which)} tables for {len(self.rows)} rows")

    @classmethod
    def joined(cls, parts: Sequence["RowKeys"]) -> "RowKeys":
        """One ``RowKeys`` of ``parts`` in order."""
        heads: list[bytes] = []
        which, rows = [], []
        for part in parts:
            which.append(part.which + len(heads))
            rows.append(part.rows)
            heads.extend(part.heads)
        empty = [np.zeros([0], np.int64)]
        return cls(heads, np.concatenate(which or empty), np.concatenate(rows or empty))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> bytes:
        row = int(self.rows[i])
        return self.heads[int(self.which[i])] + b"%d}/%d" % (row // BLOCK_ROWS, row)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def pieces(self, order: np.ndarray) -> list:
        """The keys of ``order`` as pieces of :func:`framed` (from ``$`` to the key's
        ``\\r\\n``)."""
        which, rows = self.which[order], self.rows[order]
        width = max((len(h) for h in self.heads), default=0)
        table = np.zeros([len(self.heads), width], np.uint8)
        lengths = np.array([len(h) for h in self.heads], np.int64)
        for t, head in enumerate(self.heads):
            table[t, :len(head)] = np.frombuffer(head, np.uint8)
        head_kept = np.arange(width) < lengths[which][:, None]
        block_pieces, block_bytes = signed_digits(rows // BLOCK_ROWS)
        row_pieces, row_bytes = signed_digits(rows)
        key_bytes = lengths[which] + 2 + block_bytes + row_bytes
        return ([(b"$", None), decimal_digits(key_bytes), (b"\r\n", None),
                 (table[which], head_kept)] + block_pieces + [(b"}/", None)] + row_pieces +
                [(b"\r\n", None)])

    def mget_records(self, order: np.ndarray, starts: np.ndarray) -> list[bytes]:
        """The ``MGET``s (RESP) of the keys of ``order``, a new one where ``starts`` is
        True: each key's record (its command's header in front of a first key), built in
        one pass. A request reads a few hundred keys, too few for :meth:`pieces`' NumPy
        framing to pay off; its lengths come from NumPy, the records from one format."""
        which, rows = self.which[order], self.rows[order]
        blocks = rows // BLOCK_ROWS
        head_bytes = np.array([len(h) for h in self.heads], np.int64)
        key_bytes = head_bytes[which] + 2 + decimal_width(blocks) + decimal_width(rows)
        run = np.cumsum(starts) - 1
        sizes = np.bincount(run)
        commands = [b"*%d\r\n$4\r\nMGET\r\n" % (size + 1) for size in sizes.tolist()]
        firsts = np.flatnonzero(starts).tolist()
        fronts = [b""] * len(order)
        for at, command in zip(firsts, commands):
            fronts[at] = command
        heads = self.heads
        return [b"%s$%d\r\n%s%d}/%d\r\n" % (front, size, heads[t], block, row)
                for front, size, t, block, row in zip(
                    fronts, key_bytes.tolist(), which.tolist(), blocks.tolist(),
                    rows.tolist())]


# 10 ** k for k = 0 .. 19, what a decimal width is read against
_POWERS_OF_TEN = np.array([10 ** k for k in range(20)], np.uint64)


def decimal_width(numbers: np.ndarray) -> np.ndarray:
    """How many characters each of ``numbers`` (int64) takes in decimal, sign included.

    >>> decimal_width(np.array([0, 9, 10, -1, -100, 2 ** 63 - 1, -2 ** 63])).tolist()
    [1, 1, 2, 2, 4, 19, 20]
    """
    negative, magnitude = _sign_and_magnitude(numbers)
    digits = np.maximum(np.searchsorted(_POWERS_OF_TEN, magnitude, side="right"), 1)
    return digits + negative


def _sign_and_magnitude(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(negative, magnitude as uint64) of int64 ``numbers``."""
    negative = numbers < 0
    # int64's least value has no positive twin: its magnitude is read as unsigned
    return negative, np.where(negative, -numbers, numbers).astype(np.uint64)


def signed_digits(numbers: np.ndarray) -> tuple[list, np.ndarray]:
    """Pieces of :func:`framed` that write ``numbers`` (int64, any sign) in decimal, and
    how many bytes each takes."""
    negative, magnitude = _sign_and_magnitude(numbers)
    digits, kept = decimal_digits(magnitude)
    return [(b"-", negative), (digits, kept)], kept.sum(axis=1) + negative


def framed(pieces: list, n: int, tail: bytes = b"") -> np.ndarray:
    """``n`` records made of ``pieces`` (each ``(bytes or uint8 [n, w], kept)``: ``kept``
    None for all of it, bool [n] per record or [n, w] per byte), joined, then ``tail``.

    A record's parts sit in fixed columns of one [n, width] array, each number
    right-aligned in a field as wide as its largest; one boolean mask then drops the
    bytes a record leaves out: no key or command is built in Python, which cost more
    CPU per key than Redis spends on it."""
    parts = [(np.frombuffer(p, np.uint8) if isinstance(p, bytes) else p, k)
             for p, k in pieces]
    width = sum(p.shape[-1] for p, _ in parts)
    out = np.empty([n, width], np.uint8)
    kept = np.ones([n, width], bool)
    at = 0
    for part, part_kept in parts:
        out[:, at:at + part.shape[-1]] = part
        if part_kept is not None:
            kept[:, at:at + part.shape[-1]] = (part_kept if part_kept.ndim == 2
                                               else part_kept[:, None])
        at += part.shape[-1]
    return np.concatenate([out[kept], np.frombuffer(tail, np.uint8)])


def mset_payload(keys: RowKeys, order: np.ndarray, values: np.ndarray,
                 starts: np.ndarray, tail: bytes = b"") -> np.ndarray:
    """The ``MSET``s (RESP) that write ``values[i]`` (uint8 [n, size], in ``order``'s
    order) under the keys of ``order``, a new ``MSET`` where ``starts`` is True, then
    ``tail``, as one uint8 array ready to send.

    >>> keys = RowKeys([b"p/{t/0/"], np.array([0, 0]), np.array([9, 64]))
    >>> out = bytes(mset_payload(keys, np.array([0, 1]), np.array([[1], [2]], np.uint8),
    ...                          np.array([True, False])))
    >>> out.split(b"\\r\\n")[:7]
    [b'*5', b'$4', b'MSET', b'$11', b'p/{t/0/0}/9', b'$1', b'\\x01']
    >>> out.split(b"\\r\\n")[7:]
    [b'$12', b'p/{t/0/1}/64', b'$1', b'\\x02', b'']
    """
    run = np.cumsum(starts) - 1
    key_pieces = keys.pieces(order)
    return framed([(b"*", starts), decimal_digits(2 * np.bincount(run)[run] + 1, starts),
                   (b"\r\n$4\r\nMSET\r\n", starts)] + key_pieces +
                  [(b"$%d\r\n" % values.shape[1], None), (values, None), (b"\r\n", None)],
                  len(order), tail)


def by_master_slot(owners: np.ndarray, slots: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, tagged, new_slot): the keys' indices by master, then slot (stable), each
    one's ``owner * SLOTS + slot`` in that order, and where a slot's keys begin."""
    tagged = owners * SLOTS + slots
    order = np.argsort(tagged, kind="stable")
    tagged = tagged[order]
    return order, tagged, np.concatenate([[True], tagged[1:] != tagged[:-1]])


class KeptSockets:
    """One plain socket per master, kept open between calls, for requests that must cost
    little CPU: a request goes to every master at once from the calling thread (each
    payload sent as fast as its master takes it, replies read as they come in,
    ``selectors``), its replies parsed by hiredis' C reader. redis-py's connection objects
    spend most of a request on Python work per reply (about 1.5 of 3.7 ms of a batch of 64
    reads here).

    A request it cannot finish simply (a connection that fails or closes, an error reply
    such as ``MOVED``, ``-LOADING`` or ``-CLUSTERDOWN``, no answer within the deadline)
    reports that master as failed, its socket closed: the store then sends that part the
    redis-py way, which follows the cluster's changes and names the node at fault. TLS
    connections always go that way.

    Example (needs a running cluster; the one of ``tfhybrid.testing.redis_cluster``)::

        import time
        import numpy as np
        from tfhybrid.serving import RedisStore
        from tfhybrid.serving.wire import KeptSockets
        from tfhybrid.testing.redis_cluster import LocalRedisCluster
        with LocalRedisCluster() as cluster:
            store = RedisStore(cluster.nodes, password=cluster.password)
            store.put([b"k"], [b"v"])
            node = store.client().get_node_from_key(b"k")
            sockets = KeptSockets(None, cluster.password)
            assert sockets.attempt(sockets.get, [node], np.zeros([1], np.int64), [b"k"],
                                   store.slots_of([b"k"]), time.monotonic() + 5) == [b"v"]
            sockets.reset()
            store.close()
    """

    def __init__(self, username: str | None, password: str | None):
        self.auth = None if password is None else packed(
            b"AUTH", ([username.encode()] if username else []) + [password.encode()])
        self.sockets: dict[str, tuple[socket.socket, Any]] = {}
        self.lock = threading.Lock()

    def close(self, names: Sequence[str] | None = None) -> None:
        """Closes the sockets (of masters ``names``; the caller holds ``lock``)."""
        for name in list(self.sockets) if names is None else names:
            sock, _ = self.sockets.pop(name, (None, None))
            if sock is not None:
                sock.close()

    def reset(self) -> None:
        """Closes the sockets once no request uses them (the cluster changed)."""
        with self.lock:
            self.close()

    def _open(self, node: Any, deadline: float) -> None:
        import hiredis

        if node.name not in self.sockets:
            sock = socket.create_connection((node.host, node.port),
                                            timeout=max(0.001, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sockets[node.name] = (sock, hiredis.Reader())
            if self.auth is not None and self._exchange(
                    {node.name: self.auth}, {node.name: 1}, deadline)[node.name] != [b"OK"]:
                # refused or no answer: redis-py's request says which
                raise ConnectionError(f"AUTH: no OK from {node.name}")

    def _exchange(self, payloads: dict[str, Any], wanted: dict[str, int], deadline: float
                  ) -> dict[str, list | None]:
        """Sends each master's payload (bytes-like) and reads ``wanted[name]`` replies
        from it, the masters at once; a master's replies are None where it answered an
        error, closed, or did not finish by the deadline (its socket then closed)."""
        replies: dict[str, list | None] = {name: [] for name in payloads}
        unsent = {name: memoryview(payload).cast("B") for name, payload in payloads.items()}
        with selectors.DefaultSelector() as selector:
            for name in payloads:
                self.sockets[name][0].setblocking(False)
                selector.register(self.sockets[name][0],
                                  selectors.EVENT_READ | selectors.EVENT_WRITE, name)

            def finish(name: str, failed: bool) -> None:
                selector.unregister(self.sockets[name][0])
                if failed:
                    replies[name] = None
                    self.close([name])

            while selector.get_map():
                ready = selector.select(max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                for key, events in ready:
                    name, sock = key.data, key.fileobj
                    if events & selectors.EVENT_WRITE:
                        unsent[name] = unsent[name][sock.send(unsent[name]):]
                        if not unsent[name]:
                            selector.modify(sock, selectors.EVENT_READ, name)
                    if not events & selectors.EVENT_READ:
                        continue
                    data = sock.recv(1 << 20)
                    reader, out = self.sockets[name][1], replies[name]
                    reader.feed(data)
                    reply = reader.gets()
                    while reply is not False and not isinstance(reply, Exception):
                        out.append(reply)
                        reply = reader.gets()
                    if not data or reply is not False or len(out) >= wanted[name]:
                        finish(name, failed=bool(not data or reply is not False))
            for key in list(selector.get_map().values()):
                finish(key.data, failed=True)
        return replies

    def attempt(self, request: Callable[..., Any], *args: Any) -> Any:
        """``request(*args)`` holding the sockets; None where another thread holds them
        (that caller uses redis-py) or it failed (every socket closed)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            import hiredis

            try:
                result = request(*args)
            except (OSError, hiredis.ProtocolError):
                result = None
            if result is None:
                self.close()
            return result
        finally:
            self.lock.release()

    def get(self, nodes: list, owners: np.ndarray, keys: Sequence[bytes] | RowKeys,
            slots: np.ndarray, deadline: float) -> list | None:
        """The values of ``keys`` (``owners``: each key's index in ``nodes``, the masters),
        or None where the store must read them with redis-py (call by :meth:`attempt`)."""
        # keys by master, then slot: a master's request is one contiguous range of them,
        # an MGET per slot, its header in front of the slot's first key
        order, tagged, new_slot = by_master_slot(owners, slots)
        starts = np.flatnonzero(new_slot)
        masters = np.unique(owners).tolist()
        ends = np.searchsorted(tagged, [(n + 1) * SLOTS for n in masters]).tolist()
        wanted = dict(zip((nodes[n].name for n in masters),
                          np.bincount(owners[order[starts]], minlength=len(nodes))[
                              masters].tolist()))
        payloads = {}
        if isinstance(keys, RowKeys):
            records = keys.mget_records(order, new_slot)
        else:
            heads = [b""] * len(order)
            sizes = np.diff(np.append(starts, len(order))).tolist()
            for at, size in zip(starts.tolist(), sizes):
                heads[at] = b"*%d\r\n$4\r\nMGET\r\n" % (size + 1)
            records = [b"%s$%d\r\n%s\r\n" % (head, len(key), key)
                       for head, key in zip(heads, map(keys.__getitem__, order.tolist()))]
        parts = [b"".join(records[a:b]) for a, b in zip([0] + ends[:-1], ends)]
        for n, part in zip(masters, parts):
            self._open(nodes[n], deadline)
            payloads[nodes[n].name] = part
        replies = self._exchange(payloads, wanted, deadline)
        if any(reply is None for reply in replies.values()):
            return None
        # the masters' replies in key order: by master, then slot
        values = np.empty(len(order), object)
        values[order] = [value for n in masters for reply in replies[nodes[n].name]
                         for value in reply]
        return values.tolist()

    def put(self, nodes: list, owners: np.ndarray, slots: np.ndarray, keys: RowKeys,
            values: np.ndarray, replicas: list[int], wait_ms: int, deadline: float,
            written: np.ndarray) -> bool:
        """Writes ``values[i]`` under ``keys[i]`` (``owners``: each row's index in
        ``nodes``, the masters), an ``MSET`` per slot run, each master's request ending
        with ``WAIT`` for its ``replicas[n]``; marks in ``written`` the rows its master
        acknowledged, the rest for redis-py. True once every master answered or failed
        (call by :meth:`attempt`, whose None says the request broke off: ``written`` then
        holds what was acknowledged)."""
        # rows by master, then slot: a master's request is one contiguous range of them,
        # an MSET per run of at most RUN_KEYS rows of one slot
        order, tagged, new_slot = by_master_slot(owners, slots)
        first = np.flatnonzero(new_slot)[np.cumsum(new_slot) - 1]
        starts = (np.arange(len(order)) - first) % RUN_KEYS == 0
        masters = np.flatnonzero(np.bincount(owners, minlength=len(nodes))).tolist()
        bounds = np.searchsorted(tagged, [n * SLOTS for n in masters + [len(nodes)]])
        payloads, wanted, ranges = {}, {}, {}
        for n, begin, end in zip(masters, bounds[:-1].tolist(), bounds[1:].tolist()):
            self._open(nodes[n], deadline)
            mine = order[begin:end]
            # WAIT last on the same connection, which is what WAIT counts the writes of
            wait = packed(b"WAIT", [b"%d" % replicas[n], b"%d" % wait_ms])
            name = nodes[n].name
            payloads[name] = mset_payload(keys, mine, values[mine], starts[begin:end],
                                          wait if replicas[n] else b"")
            msets = int(starts[begin:end].sum())
            wanted[name] = msets + bool(replicas[n])
            ranges[name] = (mine, msets, replicas[n])
        for name, replies in self._exchange(payloads, wanted, deadline).items():
            mine, msets, waited = ranges[name]
            if replies is not None and all(r == b"OK" for r in replies[:msets]) and (
                    not waited or isinstance(replies[-1], int) and replies[-1] >= waited):
                written[mine] = True
        return True
