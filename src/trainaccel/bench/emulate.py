"""Emulated multi-node clusters on one machine: a network namespace per node, a shaped link each.

Nodes hang off a bridge (in a namespace of its own) through veth pairs; `tc tbf` limits each
direction of every node's link. Processes of one node talk over the node's own stack, so
intra-node traffic never crosses the shaped link. With `node-cpus`, each node's processes run in
a cgroup of their own capped at that many cores (CFS quota): a node's compute stays its own, as on
a real cluster, instead of passing to the others when it is lost. Everything is removed on exit,
error or Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SUBNET = "10.213.0"  # lives only inside the namespaces made here
IFACE = "eth0"
_LINK = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_SCALE = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
HELP = (
    "emulated cluster on this machine, e.g. nodes=2,procs-per-node=2,link=500mbit (needs root); each worker gets "
    "OMP_NUM_THREADS = cores / all workers unless it is set; node-cpus=C caps each node at C cores (a cgroup each), "
    "so that a lost node's cores do not pass to the others; store=etcd puts the trainaccel arms' store on an etcd "
    "member in each of nodes 0-2, in its network but outside its core cap, its data in memory (then --lose may take "
    "node 0, every process in its namespace with it)"
)
CPU_CGROUPS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup")  # cgroup v1's cpu controller, or v2's unified tree
CPU_PERIOD_US = 10_000  # a short period: a node out of quota waits at most this long, not the default 100 ms


class EmulationError(RuntimeError):
    """The emulated cluster cannot be built here; the message says what is needed."""


@dataclasses.dataclass(frozen=True)
class Emulation:
    nodes: int
    procs_per_node: int
    link: str  # tc rate, e.g. 500mbit
    node_cpus: float | None = None  # cores each node may use (a cgroup's CPU quota); None: all nodes share them all
    store: str = "agent"  # the trainaccel arms' store: agent (torchrun's, on node 0) or etcd (a member on nodes 0-2)

    @property
    def link_bits_per_s(self) -> float:
        value, unit = _LINK.match(self.link).groups()  # type: ignore[union-attr]
        return float(value) * _SCALE[unit]

    @property
    def workers(self) -> int:
        """Every node's workers: the job's world size."""
        return self.nodes * self.procs_per_node

    @property
    def threads_per_worker(self) -> int:
        """OpenMP threads per worker: this machine's cores shared out among every node's workers.

        On a real cluster each node has its cores to itself; here all nodes share this machine's, and
        torchrun leaves a lone worker per node at all of them, so the nodes' OpenMP threads oversubscribe
        the cores and wait on each other (3 nodes x 1 worker on 2 cores: 6 threads, steps 2-4x slower).
        """
        if self.node_cpus is not None:
            return max(1, int(self.node_cpus) // self.procs_per_node)
        return max(1, (os.cpu_count() or 1) // self.workers)

    def node_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a node's launcher: Gloo on the node's shaped link, `threads_per_worker` unless env sets them."""
        return {"OMP_NUM_THREADS": str(self.threads_per_worker), **env, "GLOO_SOCKET_IFNAME": IFACE}


def parse_emulate(spec: str) -> Emulation:
    """`nodes=2,procs-per-node=2,link=500mbit[,node-cpus=0.5][,store=etcd]` -> Emulation."""
    cores = os.cpu_count() or 1
    accepted = (
        "nodes=N,procs-per-node=P,link=RATE[,node-cpus=C][,store=STORE] with N >= 2, P >= 1, RATE like 500mbit or "
        f"2gbit, C the cores each node may use (> 0, at most {cores}; e.g. {cores / 3:.2f} for 3 nodes sharing this "
        "machine), STORE the trainaccel arms' store: agent (torchrun's, on node 0; the default) or etcd (a 3-member "
        "cluster, a member on each of nodes 0-2: N >= 3)"
    )
    fields = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in ("nodes", "procs-per-node", "link", "node-cpus", "store") or key in fields:
            raise ValueError(f"invalid --emulate {spec!r}; accepted: {accepted}")
        fields[key] = value.strip().lower()
    try:
        node_cpus = float(fields["node-cpus"]) if "node-cpus" in fields else None
        emulation = Emulation(
            int(fields["nodes"]), int(fields["procs-per-node"]), fields["link"], node_cpus, fields.get("store", "agent")
        )
    except (KeyError, ValueError):
        raise ValueError(f"invalid --emulate {spec!r}; accepted: {accepted}") from None
    if emulation.nodes < 2 or emulation.procs_per_node < 1 or not _LINK.match(emulation.link):
        raise ValueError(f"invalid --emulate {spec!r}; accepted: {accepted}")
    if emulation.store not in ("agent", "etcd") or (emulation.store == "etcd" and emulation.nodes < 3):
        raise ValueError(f"invalid --emulate {spec!r}: store={emulation.store}; accepted: {accepted}")
    if node_cpus is not None and not (0 < node_cpus <= cores and round(node_cpus * CPU_PERIOD_US) >= 1000):
        raise ValueError(f"invalid --emulate {spec!r}: node-cpus={fields['node-cpus']}; accepted: {accepted}")
    return emulation


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _ip(*args: str, netns: str | None = None) -> None:
    _run(["ip", *(["-n", netns] if netns else []), *args])


def _tc(netns: str, *args: str) -> None:
    _run(["ip", "netns", "exec", netns, "tc", *args])


def namespaces(prefix: str) -> list[str]:
    """The network namespaces whose names start with `prefix`."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def why_not_emulated() -> str | None:
    """What this machine lacks to build an emulated cluster, or None when it can."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return "root and iproute2 (`ip netns`, `tc`) to build network namespaces"
    return None


def cpu_cgroup_root() -> tuple[str, int] | None:
    """Where nodes' CPU cgroups can be made, and the cgroup version (1 or 2); None if this machine has no such tree."""
    v1, v2 = CPU_CGROUPS
    if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):  # the file a cap is written to (cpu.shares cannot cap)
        return v1, 1
    try:
        with open(os.path.join(v2, "cgroup.subtree_control")) as f:
            if "cpu" in f.read().split():
                return v2, 2
    except OSError:
        pass
    return None


class EmulatedCluster:
    """Context manager: builds the namespaces and links on enter, removes all of them on exit."""

    def __init__(self, emulation: Emulation, prefix: str | None = None):
        self.emulation = emulation
        self.prefix = prefix or f"ta{os.getpid()}-"
        self.bridge = self.prefix + "br"
        self.nodes = [f"{self.prefix}n{k}" for k in range(emulation.nodes)]
        self.cgroups: list[str] = []  # each node's CPU cgroup (node-cpus), made in _build
        self.etcd: Any = None  # under store=etcd: the job's store, a member in each of nodes 0-2 (bench.stores)
        self._etcd_data: Path | None = None  # its members' data, removed with it

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        """Prefix a command with this to run it inside node `node` (its network, and its cores under node-cpus)."""
        prefix = ["ip", "netns", "exec", self.nodes[node]]
        if self.cgroups:  # the shell joins the node's cgroup, then becomes the command: its children stay in it
            # (before the namespace: `ip netns exec` mounts a sysfs of its own, where the cgroup tree is not)
            prefix = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.cgroups[node], *prefix]
        return prefix

    def __enter__(self) -> EmulatedCluster:
        missing = why_not_emulated()
        if missing is not None:
            raise EmulationError(f"--emulate needs {missing}; run as root on Linux, or drop --emulate")
        if self.emulation.node_cpus is not None and cpu_cgroup_root() is None:
            raise EmulationError(
                f"--emulate node-cpus needs a CPU cgroup tree (none at {' or '.join(CPU_CGROUPS)}); drop node-cpus"
            )
        try:
            self._build()
        except BaseException:
            try:
                self.teardown()
            except EmulationError as cleanup:  # said beside it: the build's own error is what went wrong
                print(f"trainaccel: {cleanup}", file=sys.stderr)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    @property
    def store(self) -> str | None:
        """Under store=etcd, the store's address for `trainaccel run --store`; else None."""
        return self.etcd.url if self.etcd is not None else None

    def kill_node(self, node: int) -> None:
        """SIGKILL every process left in node `node`'s namespace (its store member too): the node lost whole."""
        found = subprocess.run(["ip", "netns", "pids", self.nodes[node]], capture_output=True, text=True)
        for pid in found.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _start_store(self) -> None:
        from trainaccel.bench.stores import EtcdCluster

        # Each member in its node's network (lost with it), but not on its node's capped cores, and its data in
        # memory: a cluster's etcd has cores and a disk of its own, where here the members' work and every write's
        # fsync came out of the capped workers' share (a member took a third of a core under 4 nodes' heartbeats).
        memory = Path("/dev/shm")
        scratch = Path(tempfile.mkdtemp(prefix=self.prefix + "etcd-", dir=memory if memory.is_dir() else None))
        try:
            self.etcd = EtcdCluster(
                scratch,
                hosts=[self.address(k) for k in range(3)],
                prefixes=[["ip", "netns", "exec", self.nodes[k]] for k in range(3)],
            )
        except RuntimeError as e:
            shutil.rmtree(scratch, ignore_errors=True)
            raise EmulationError(f"--emulate store=etcd: {e}") from None
        self._etcd_data = scratch

    def _build(self) -> None:
        rate = self.emulation.link
        _ip("netns", "add", self.bridge)
        _ip("link", "add", "br0", "type", "bridge", netns=self.bridge)
        _ip("link", "set", "br0", "up", netns=self.bridge)
        for k, ns in enumerate(self.nodes):
            _ip("netns", "add", ns)
            port = f"p{k}"
            _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge)
            _ip("addr", "add", f"{self.address(k)}/24", "dev", IFACE, netns=ns)
            _ip("link", "set", IFACE, "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("link", "set", port, "master", "br0", netns=self.bridge)
            _ip("link", "set", port, "up", netns=self.bridge)
            # Both directions of the node's link: what it sends, and what the bridge sends it.
            for netns, dev in ((ns, IFACE), (self.bridge, port)):
                _tc(
                    netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"
                )
        if self.emulation.node_cpus is not None:
            self._cap_cpus(self.emulation.node_cpus)
        if self.emulation.store == "etcd":
            self._start_store()

    def _cap_cpus(self, cores: float) -> None:
        root, version = cpu_cgroup_root()  # type: ignore[misc]
        quota = round(cores * CPU_PERIOD_US)
        for ns in self.nodes:
            path = os.path.join(root, ns)
            os.mkdir(path)
            self.cgroups.append(path)
            if version == 1:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(path, "cpu.max"), f"{quota} {CPU_PERIOD_US}")

    def teardown(self) -> None:
        """Delete every namespace of this cluster (their veths go with them) and its cgroups; safe to repeat."""
        if self.etcd is not None:
            self.etcd.close()
            shutil.rmtree(self._etcd_data, ignore_errors=True)
            self.etcd = None
        for ns in namespaces(self.prefix):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        found = cpu_cgroup_root()
        for path in glob.glob(os.path.join(found[0], glob.escape(self.prefix) + "*")) if found else []:
            try:  # a process still in it (none once the job ended) goes back to the root first
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        _write(os.path.join(found[0], "cgroup.procs"), pid, missing_ok=True)
                os.rmdir(path)
            except OSError as e:
                raise EmulationError(f"could not remove the node cgroup {path}: {e}") from None
        self.cgroups = []


def _write(path: str, value: str, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except ProcessLookupError:  # (a process that ended as it was moved)
        if not missing_ok:
            raise
