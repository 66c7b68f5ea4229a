"""An emulated multi-node cluster on one machine, for tests and benchmarks.

Each *node* is a network namespace with one interface, ``hnet0``, plugged into a
bridge (the *switch*, in a namespace of its own), and an sshd listening on the node's
address. Traffic between ranks of one node stays on that namespace's loopback; traffic
between nodes crosses two veth links, each shaped by ``tc tbf`` to the chosen bandwidth
in both directions (a node's NIC: its ranks share it, as on a real host). Latency is
added with ``netem`` where the kernel has it (this machine kind's kernel does not: asking
for latency there raises).

Jobs run as real multi-host Horovod jobs, the command a user types on two DGX nodes::

    horovodrun -np 4 -H node0:2,node1:2 --gloo --network-interfaces hnet0 python ...

started inside node0's namespace; horovodrun reaches node1 over ssh.

Two things a user's cluster needs too, which the harness sets up per namespace through
``/etc/netns/<ns>/`` (``ip netns exec`` bind-mounts those files over ``/etc``, so the
machine's own files are never changed):

* ``hosts``: the node names, and **the machine's hostname mapped to the node's own
  address**. Horovod 0.28.1 builds the Gloo context of every process set from
  ``socket.gethostname()`` (it ignores ``HOROVOD_GLOO_IFACE`` there); where the hostname
  resolves to a loopback address (127.0.1.1 on many distributions) every process set
  that spans nodes fails with a Gloo connect error to 127.0.0.1.
* ``ssh/ssh_config``: a throwaway key, no host-key prompts.

Only addresses in the benchmarking range 198.18.0.0/15 are used, on interfaces this
module creates; one cluster exists at a time (a lock); every command is bounded in time;
everything is torn down on exit, on an exception, on Ctrl-C and on SIGTERM, and a
cluster left behind by a killed process is removed by the next one.

Example (as root)::

    with EmulatedCluster(nodes=2, ranks_per_node=2, bandwidth_mbit=500) as cluster:
        result = cluster.horovodrun(["python", "-c", "import horovod"], timeout=120)
        print(result.returncode, result.stdout)

Command line: ``python -m tfhybrid.testing.cluster --nodes 2 --ranks-per-node 2
--bandwidth-mbit 500 -- python -m tfhybrid.train ...``
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

# RFC 2544's benchmarking range: never routed, never a real host's address
SUBNET = ipaddress.ip_network("198.18.0.0/24")
ALLOWED_RANGE = ipaddress.ip_network("198.18.0.0/15")
NODE_INTERFACE = "hnet0"
# namespaces are named <PREFIX><owner pid>-<role>, so that a leftover's owner is known
PREFIX = "tfhc"
NETNS_ETC = "/etc/netns"
LOCK_PATH = "/run/lock/tfhybrid-cluster.lock"
# a tbf queue much shorter than this drops packets under a few concurrent flows
TBF_LATENCY_MS = 100
# the queue must hold a whole 64 KiB GSO packet, and a few of them
TBF_MIN_BURST_BYTES = 256 * 1024
COMMAND_TIMEOUT_S = 30
LOCK_TIMEOUT_S = 600
SSHD_START_TIMEOUT_S = 15


def _run(cmd: list[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True
         ) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"emulated cluster: {' '.join(cmd)} failed with exit code "
                           f"{result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(namespace: str) -> list[int]:
    out = _run(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all_in(namespace: str, grace_s: float = 5.0) -> None:
    """Ends every process in ``namespace``: ranks started over ssh outlive a failed
    horovodrun, so they are found by namespace, not by parentage."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(namespace)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while pids and time.time() < deadline:
            pids = [p for p in pids if _alive(p) and not _is_zombie(p)]
            time.sleep(0.1)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _delete_namespace(namespace: str) -> None:
    _kill_all_in(namespace)
    shutil.rmtree(os.path.join(NETNS_ETC, namespace), ignore_errors=True)
    _run(["ip", "netns", "del", namespace], check=False)


def leftovers() -> list[str]:
    """Namespaces and /etc/netns folders of emulated clusters that exist now."""
    found = {ns for ns in _namespaces() if re.match(rf"{PREFIX}\d+-", ns)}
    if os.path.isdir(NETNS_ETC):
        found |= {d for d in os.listdir(NETNS_ETC) if re.match(rf"{PREFIX}\d+-", d)}
    return sorted(found)


def remove_orphans() -> list[str]:
    """Removes the clusters whose owner process is gone; returns what it removed."""
    removed = []
    for name in leftovers():
        owner = int(re.match(rf"{PREFIX}(\d+)-", name).group(1))
        if not _alive(owner) or owner == os.getpid():
            _delete_namespace(name)
            removed.append(name)
    return removed


def check_can_run() -> None:
    """RuntimeError saying what is missing when this machine cannot host a cluster."""
    problems = []
    if os.geteuid() != 0:
        problems.append("it must run as root (network namespaces, tc)")
    for tool in ("ip", "tc", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            problems.append(f"{tool!r} is not installed")
    if not os.path.exists("/usr/sbin/sshd"):
        problems.append("/usr/sbin/sshd is not installed (Debian: openssh-server; "
                        "`make setup` installs it)")
    if problems:
        raise RuntimeError("the emulated cluster cannot start: " + "; ".join(problems))


@dataclass(frozen=True)
class Node:
    """One emulated host: its name, namespace and address."""
    name: str
    namespace: str
    address: str


class EmulatedCluster:
    """``nodes`` hosts with ``ranks_per_node`` slots each, linked at ``bandwidth_mbit``.

    ``bandwidth_mbit=None`` leaves the links unshaped (veth speed, CPU-bound here).
    ``latency_ms`` adds one-way delay on each link and needs the kernel's ``netem``.
    Use as a context manager; :meth:`horovodrun` runs one job, bounded in time.

    >>> cluster = EmulatedCluster(nodes=2, ranks_per_node=2, bandwidth_mbit=250)
    >>> cluster.host_flag()
    'node0:2,node1:2'
    """

    def __init__(self, nodes: int = 2, ranks_per_node: int = 2,
                 bandwidth_mbit: float | None = None, latency_ms: float | None = None):
        if not isinstance(nodes, int) or not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be an int in [1, 200], got {nodes!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if bandwidth_mbit is not None and not bandwidth_mbit > 0:
            raise ValueError(f"bandwidth_mbit must be > 0 or None, got {bandwidth_mbit!r}")
        if latency_ms is not None and not latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0 or None, got {latency_ms!r}")
        self.ranks_per_node = ranks_per_node
        self.bandwidth_mbit = bandwidth_mbit
        self.latency_ms = latency_ms or None
        tag = f"{PREFIX}{os.getpid()}"
        self.switch_namespace = f"{tag}-sw"
        hosts = list(SUBNET.hosts())
        self.nodes = [Node(f"node{i}", f"{tag}-n{i}", str(hosts[i])) for i in range(nodes)]
        for node in self.nodes:
            assert ipaddress.ip_address(node.address) in ALLOWED_RANGE
        self._workdir: str | None = None
        self._lock = None
        self._sshd: list[subprocess.Popen] = []
        self._old_sigterm = None
        self.setup_seconds = self.teardown_seconds = 0.0

    # -- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Creates the namespaces, links, shaping and sshds; tears down what it made on
        any failure."""
        check_can_run()
        start = time.time()
        os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
        self._lock = open(LOCK_PATH, "w")
        deadline = time.time() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise RuntimeError(f"another emulated cluster held {LOCK_PATH} for "
                                       f"{LOCK_TIMEOUT_S} s")
                time.sleep(1)
        # a SIGTERM (a test runner's timeout) must tear down, like Ctrl-C does; only the
        # main thread may install a handler
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            remove_orphans()
            self._workdir = tempfile.mkdtemp(prefix="tfhybrid-cluster-")
            self._make_keys()
            self._make_network()
            for node in self.nodes:
                self._write_etc(node)
            for node in self.nodes:
                self._start_sshd(node)
        except BaseException:
            self.down()
            raise
        self.setup_seconds = time.time() - start

    def down(self) -> None:
        """Removes everything :meth:`up` made; safe to call more than once."""
        start = time.time()
        for proc in self._sshd:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._sshd = []
        for name in [n.namespace for n in self.nodes] + [self.switch_namespace]:
            _delete_namespace(name)
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        self.teardown_seconds = time.time() - start

    # -- setup steps ------------------------------------------------------------------
    def _make_keys(self) -> None:
        for key in ("client_key", "host_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfhybrid-cluster",
                  "-f", os.path.join(self._workdir, key)])
        shutil.copy(os.path.join(self._workdir, "client_key.pub"),
                    os.path.join(self._workdir, "authorized_keys"))

    def _make_network(self) -> None:
        sw = self.switch_namespace
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, node in enumerate(self.nodes):
            ns, port = node.namespace, f"port{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", NODE_INTERFACE, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", sw])
            _run(["ip", "-n", ns, "addr", "add", f"{node.address}/{SUBNET.prefixlen}",
                  "dev", NODE_INTERFACE])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", NODE_INTERFACE, "up"])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            # upload: the node's egress; download: the switch port's egress to the node
            self._shape(ns, NODE_INTERFACE)
            self._shape(sw, port)

    def set_bandwidth(self, bandwidth_mbit: float | None) -> None:
        """Reshapes every link to ``bandwidth_mbit`` (None: unshaped) between jobs."""
        if bandwidth_mbit is not None and not bandwidth_mbit > 0:
            raise ValueError(f"bandwidth_mbit must be > 0 or None, got {bandwidth_mbit!r}")
        self.bandwidth_mbit = bandwidth_mbit
        for i, node in enumerate(self.nodes):
            for namespace, device in ((node.namespace, NODE_INTERFACE),
                                      (self.switch_namespace, f"port{i}")):
                _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device,
                      "root"], check=False)  # fails harmlessly where nothing was shaped
                self._shape(namespace, device)

    def _shape(self, namespace: str, device: str) -> None:
        base = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
        parent = ["root"]
        if self.latency_ms is not None:
            result = _run(base + ["root", "handle", "1:", "netem", "delay",
                                  f"{self.latency_ms}ms"], check=False)
            if result.returncode != 0:
                raise RuntimeError(
                    f"latency_ms={self.latency_ms} needs the kernel's netem qdisc, which "
                    f"this kernel lacks ({result.stderr.strip()}); emulate bandwidth only "
                    f"(latency_ms=None)")
            parent = ["parent", "1:1", "handle", "10:"]
        if self.bandwidth_mbit is not None:
            rate_bytes = self.bandwidth_mbit * 1e6 / 8
            burst = max(TBF_MIN_BURST_BYTES, int(rate_bytes / 1000))  # >= 1 ms of data
            _run(base + parent + ["tbf", "rate", f"{self.bandwidth_mbit}mbit", "burst",
                                  str(burst), "latency", f"{TBF_LATENCY_MS}ms"])

    def _write_etc(self, node: Node) -> None:
        etc = os.path.join(NETNS_ETC, node.namespace)
        os.makedirs(os.path.join(etc, "ssh"), exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{n.address} {n.name}" for n in self.nodes]
        # Horovod's process sets connect to the address the hostname resolves to
        lines.append(f"{node.address} {socket.gethostname()}")
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")
        names = " ".join(n.name for n in self.nodes)
        with open(os.path.join(etc, "ssh", "ssh_config"), "w") as f:
            f.write(f"Host {names}\n"
                    f"  IdentityFile {self._workdir}/client_key\n"
                    "  IdentitiesOnly yes\n"
                    "  StrictHostKeyChecking no\n"
                    "  UserKnownHostsFile /dev/null\n"
                    "  GlobalKnownHostsFile /dev/null\n"
                    "  LogLevel ERROR\n"
                    "  BatchMode yes\n"
                    "  ConnectTimeout 10\n")

    def _start_sshd(self, node: Node) -> None:
        config = os.path.join(self._workdir, f"sshd_{node.name}.conf")
        with open(config, "w") as f:
            f.write(f"ListenAddress {node.address}\n"
                    "Port 22\n"
                    f"HostKey {self._workdir}/host_key\n"
                    f"AuthorizedKeysFile {self._workdir}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\n"
                    "PasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\n"
                    "UsePAM no\n"
                    "StrictModes no\n"
                    "PidFile none\n"
                    "MaxStartups 100\n"
                    "MaxSessions 100\n")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        proc = subprocess.Popen(["ip", "netns", "exec", node.namespace, "/usr/sbin/sshd",
                                 "-D", "-e", "-f", config],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._sshd.append(proc)
        deadline = time.time() + SSHD_START_TIMEOUT_S
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd on {node.name} exited with {proc.returncode}: "
                                   f"{proc.stderr.read().strip()}")
            probe = _run(["ip", "netns", "exec", node.namespace, "ssh", node.name, "true"],
                         check=False)
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"sshd on {node.name} ({node.address}) did not accept a login "
                           f"within {SSHD_START_TIMEOUT_S} s: {probe.stderr.strip()}")

    # -- running jobs -----------------------------------------------------------------
    def host_flag(self, ranks_per_node: int | None = None) -> str:
        """horovodrun's ``-H``: ``node0:R,node1:R,...``."""
        r = ranks_per_node or self.ranks_per_node
        return ",".join(f"{n.name}:{r}" for n in self.nodes)

    def horovodrun_command(self, command: list[str], horovodrun: str | None = None,
                           extra_flags: list[str] | tuple = ()) -> list[str]:
        """The horovodrun command line a user would type, for this cluster's hosts."""
        horovodrun = horovodrun or os.path.join(os.path.dirname(sys.executable), "horovodrun")
        np_total = len(self.nodes) * self.ranks_per_node
        return [horovodrun, "-np", str(np_total), "-H", self.host_flag(), "--gloo",
                "--network-interfaces", NODE_INTERFACE, "--start-timeout", "60",
                *extra_flags, *command]

    def horovodrun(self, command: list[str], timeout: float, env: dict | None = None,
                   cwd: str | None = None, extra_flags: list[str] | tuple = ()
                   ) -> subprocess.CompletedProcess:
        """Runs ``command`` on every rank through horovodrun started on node0.

        Ends within ``timeout`` seconds: on overrun every process in every node is
        killed and the result's returncode is -9 with a note appended to stdout.
        After the job, whatever it left in the nodes (ranks whose horovodrun died) is
        killed, so the next job starts clean.
        """
        if self._workdir is None:
            raise RuntimeError("the cluster is not up: use `with EmulatedCluster(...)`")
        full = ["ip", "netns", "exec", self.nodes[0].namespace,
                *self.horovodrun_command(command, extra_flags=extra_flags)]
        proc = subprocess.Popen(full, env={**os.environ, **(env or {})}, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            self._kill_jobs()
            out, _ = proc.communicate()
            out += f"\n[emulated cluster: killed after {timeout} s]\n"
            code = -9
        self._kill_jobs()
        return subprocess.CompletedProcess(full, code, out, "")

    def run_for_json(self, command: list[str], result_path: str, timeout: float,
                     label: str, env: dict | None = None, cwd: str | None = None) -> dict:
        """Runs one job whose rank 0 writes ``result_path`` (JSON) and returns what it
        wrote (removing the file); raises naming ``label`` and the output's tail if the
        job failed or wrote nothing."""
        ran = self.horovodrun(command, timeout=timeout, env=env, cwd=cwd)
        if ran.returncode != 0 or not os.path.exists(result_path):
            raise RuntimeError(f"{label} failed ({ran.returncode}):\n{ran.stdout[-4000:]}")
        with open(result_path) as f:
            result = json.load(f)
        os.remove(result_path)
        return result

    def _kill_jobs(self) -> None:
        """Kills every process in the nodes except their sshds."""
        keep = {p.pid for p in self._sshd}  # `ip netns exec` execs sshd: the same pid
        for node in self.nodes:
            for pid in _pids_in(node.namespace):
                if pid not in keep:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run one horovodrun job on an emulated multi-node cluster (as root).")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--bandwidth-mbit", type=float, default=None)
    parser.add_argument("--latency-ms", type=float, default=None)
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds before the job is killed")
    parser.add_argument("--cleanup", action="store_true",
                        help="only remove clusters left by dead processes")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cleanup:
        print("removed:", remove_orphans())
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    with EmulatedCluster(args.nodes, args.ranks_per_node, args.bandwidth_mbit,
                         args.latency_ms) as cluster:
        print(f"emulated cluster up in {cluster.setup_seconds:.1f} s: "
              f"{cluster.host_flag()}, links "
              f"{'unshaped' if args.bandwidth_mbit is None else f'{args.bandwidth_mbit} Mbit/s'}",
              flush=True)
        result = cluster.horovodrun(command, timeout=args.timeout, cwd=os.getcwd())
        print(result.stdout, end="", flush=True)
    print(f"emulated cluster torn down in {cluster.teardown_seconds:.1f} s")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
