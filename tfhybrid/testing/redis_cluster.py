"""A password-protected Redis Cluster on localhost, for tests, the demo and benchmarks.

``LocalRedisCluster`` starts ``masters`` masters with ``replicas`` replicas each (Debian's
``redis-server``, installed by ``make setup``) in a temporary folder, on free ports of
127.0.0.1 only, forms the cluster with ``redis-cli --cluster create`` and waits until
every node reports ``cluster_state:ok`` and every replica is in sync. Every wait is
bounded (``start_timeout_s``); whatever was started is stopped by its process id and the
folder removed, on ``stop()``, on leaving the ``with`` block, and when starting fails.
Standard library only: a test's parent process uses it without TensorFlow or redis-py.

Example (needs ``redis-server``; about 3 s)::

    from tfhybrid.testing.redis_cluster import LocalRedisCluster
    with LocalRedisCluster(masters=3, replicas=1) as cluster:
        assert len(cluster.nodes) == 6 and len(cluster.masters()) == 3
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Sequence

# how long a master may be silent before its replicas take over: short, so a test's
# failover takes seconds; long enough that four busy ranks on two cores do not trip it
NODE_TIMEOUT_MS = 3000
# prctl's option that asks the kernel to signal a process when its parent dies
PR_SET_PDEATHSIG = 1


def _end_with_parent() -> None:
    """Runs in a server's process before it starts: the kernel ends it when the process
    that started it dies, so a test or benchmark killed by a signal (no cleanup runs)
    leaves no server behind."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port_pair() -> int:
    """A port p with p and p + 10000 (the cluster bus) free on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("found no free port p with p + 10000 free on 127.0.0.1")


class LocalRedisCluster:
    """A Redis Cluster of local ``redis-server`` processes (module docstring).

    Args:
      masters, replicas: the cluster's masters and each master's replicas.
      password: every node's ``requirepass`` and ``masterauth``; None draws one.
      start_timeout_s: the bound of every wait while starting.
      maxmemory_policy: the nodes' ``maxmemory-policy`` (``tfhybrid.serving.RedisStore``
        refuses anything but ``noeviction``; tests set another to see it refused).

    Example::

        from tfhybrid.testing.redis_cluster import LocalRedisCluster
        cluster = LocalRedisCluster(masters=3, replicas=0).start()
        try:
            assert cluster.cli(cluster.nodes[0], "PING").strip() == "PONG"
        finally:
            cluster.stop()
    """

    def __init__(self, masters: int = 3, replicas: int = 1, password: str | None = None,
                 start_timeout_s: float = 60.0, maxmemory_policy: str = "noeviction"):
        if masters < 3:
            # a Redis Cluster needs a majority of masters to fail one over
            raise ValueError(f"masters={masters!r} must be >= 3")
        if replicas < 0:
            raise ValueError(f"replicas={replicas!r} must be >= 0")
        self.masters_count = masters
        self.replicas = replicas
        self.password = password or secrets.token_hex(16)
        self.start_timeout_s = start_timeout_s
        self.maxmemory_policy = maxmemory_policy
        self.directory: str | None = None
        self.ports: list[int] = []
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def nodes(self) -> list[str]:
        """Every node as ``"127.0.0.1:port"``."""
        return [f"127.0.0.1:{p}" for p in self.ports]

    # ------------------------------------------------------------------ start
    def start(self) -> "LocalRedisCluster":
        """Starts the nodes and forms the cluster; stops everything if that fails."""
        try:
            self.directory = tempfile.mkdtemp(prefix="tfhybrid-redis-")
            count = self.masters_count * (1 + self.replicas)
            for _ in range(count):
                port = _free_port_pair()
                while port in self.ports:
                    port = _free_port_pair()
                self.ports.append(port)
                self._start_node(port)
            deadline = time.monotonic() + self.start_timeout_s
            for node in self.nodes:
                self._wait(lambda n=node: self.cli(n, "PING", check=False).strip() == "PONG",
                           deadline, f"{node} to answer PING")
            self._run(["redis-cli", "-a", self.password, "--no-auth-warning", "--cluster",
                       "create", *self.nodes, "--cluster-replicas", str(self.replicas),
                       "--cluster-yes"], deadline)
            self.wait_healthy(deadline - time.monotonic())
            return self
        except BaseException:
            self.stop()
            raise

    def _start_node(self, port: int) -> None:
        node_dir = os.path.join(self.directory, str(port))
        os.makedirs(node_dir)
        config = [
            f"port {port}", "bind 127.0.0.1", "protected-mode yes", f"dir {node_dir}",
            "cluster-enabled yes", "cluster-config-file nodes.conf",
            f"cluster-node-timeout {NODE_TIMEOUT_MS}",
            # a replica takes over however long its master was gone: tests kill masters
            "cluster-replica-validity-factor 0",
            f"requirepass {self.password}", f"masterauth {self.password}",
            f"maxmemory-policy {self.maxmemory_policy}",
            # a test's store lives in memory only: no snapshot, no append-only file
            'save ""', "appendonly no", "daemonize no", "logfile redis.log",
        ]
        path = os.path.join(node_dir, "redis.conf")
        with open(path, "w") as f:
            f.write("\n".join(config) + "\n")
        self.processes[port] = subprocess.Popen(
            ["redis-server", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_end_with_parent)

    def _run(self, command: list[str], deadline: float) -> str:
        result = subprocess.run(command, capture_output=True, text=True,
                                timeout=max(1.0, deadline - time.monotonic()))
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} {' '.join(command[3:6])} ... failed "
                               f"({result.returncode}): {result.stdout[-2000:]}"
                               f"{result.stderr[-2000:]}")
        return result.stdout

    def _wait(self, ready, deadline: float, what: str) -> None:
        while True:
            try:
                if ready():
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"LocalRedisCluster: waited {self.start_timeout_s} s "
                                   f"for {what}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ use
    def cli(self, node: str, *args: str, check: bool = True, timeout_s: float = 10.0) -> str:
        """``redis-cli`` on ``node`` (``"host:port"``) with the password; its output."""
        host, port = node.rsplit(":", 1)
        result = subprocess.run(
            ["redis-cli", "-h", host, "-p", port, "-a", self.password, "--no-auth-warning",
             *args], capture_output=True, text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"redis-cli {node} {' '.join(args)} failed: "
                               f"{result.stderr.strip()}")
        return result.stdout

    def info(self, node: str, section: str) -> dict[str, str]:
        """``INFO section`` (or ``CLUSTER INFO`` for ``"cluster"``) of ``node`` as a dict."""
        text = (self.cli(node, "CLUSTER", "INFO") if section == "cluster"
                else self.cli(node, "INFO", section))
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def alive(self) -> list[str]:
        """The nodes whose process still runs."""
        return [f"127.0.0.1:{p}" for p, proc in self.processes.items() if proc.poll() is None]

    def masters(self) -> list[str]:
        """The running nodes that are masters now."""
        return [n for n in self.alive() if self.info(n, "replication").get("role") == "master"]

    def healthy(self) -> bool:
        """Every running node says ``cluster_state:ok`` and every replica's link is up."""
        for node in self.alive():
            if self.info(node, "cluster").get("cluster_state") != "ok":
                return False
            replication = self.info(node, "replication")
            if replication.get("role") == "slave" and \
                    replication.get("master_link_status") != "up":
                return False
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        """Waits (at most ``timeout_s``) until :meth:`healthy`; TimeoutError otherwise."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        self._wait(self.healthy, deadline, "cluster_state:ok on every node")

    def kill(self, node: str) -> None:
        """Kills ``node``'s process (SIGKILL: no chance to hand over), a fault."""
        port = int(node.rsplit(":", 1)[1])
        proc = self.processes[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stops every node this object started (by process id) and removes its folder."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.processes.clear()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def nodes_arg(nodes: Sequence[str]) -> str:
    """The nodes as the app's ``--redis`` flag takes them: ``"host:port,host:port"``.

    >>> nodes_arg(["127.0.0.1:7000", "127.0.0.1:7001"])
    '127.0.0.1:7000,127.0.0.1:7001'
    """
    return ",".join(nodes)
