"""Emulated clusters: parsing, a shaped link between nodes and none within a node, full teardown."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import trainaccel_cmd
from trainaccel.bench.emulate import EmulatedCluster, Emulation, cpu_cgroup_root, namespaces, parse_emulate

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="needs root and iproute2 to build network namespaces",
)

RECEIVER = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 5901)); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); total, start = 0, None
while True:
    data = conn.recv(1 << 20)
    if not data: break
    start = start or time.perf_counter(); total += len(data)
print(total * 8 / (time.perf_counter() - start))
"""
SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5901)); s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def test_parse_emulate():
    assert parse_emulate("nodes=2,procs-per-node=2,link=500mbit") == Emulation(2, 2, "500mbit")
    assert parse_emulate("link=2Gbit, nodes=3, procs-per-node=1").link_bits_per_s == 2e9
    for bad in (
        "nodes=1,procs-per-node=2,link=1gbit",
        "nodes=2,procs-per-node=2",
        "nodes=2,procs=2,link=1gbit",
        "nodes=2,procs-per-node=2,link=fast",
        "nodes=2,procs-per-node=0,link=1gbit",
    ):
        with pytest.raises(ValueError, match="accepted: nodes=N,procs-per-node=P,link=RATE"):
            parse_emulate(bad)


def test_parse_store():
    assert parse_emulate("nodes=3,procs-per-node=1,link=1gbit,store=etcd").store == "etcd"
    assert parse_emulate("nodes=2,procs-per-node=1,link=1gbit").store == "agent"
    for bad in ("nodes=2,procs-per-node=1,link=1gbit,store=etcd", "nodes=3,procs-per-node=1,link=1gbit,store=zk"):
        with pytest.raises(ValueError, match=r"store=\w+; accepted: .*STORE the trainaccel arms' store"):
            parse_emulate(bad)


@pytest.mark.multiprocess  # ip netns, an etcd member per node
@needs_netns
def test_store_etcd_runs_a_member_in_each_of_the_first_three_nodes_and_a_lost_node_takes_its_member():
    with EmulatedCluster(parse_emulate("nodes=3,procs-per-node=1,link=1gbit,store=etcd"), "tatest-etcd-") as cluster:
        assert cluster.store == "etcd://10.213.0.1:2379,10.213.0.2:2379,10.213.0.3:2379"
        for node in range(3):  # each member listens inside its node: reached from the node next to it
            probe = f"import urllib.request; print(urllib.request.urlopen('http://{cluster.address(node)}:2379/health').read().decode())"
            out = subprocess.run(
                [*cluster.exec_prefix((node + 1) % 3), sys.executable, "-c", probe], capture_output=True, text=True
            )
            assert '"health":"true"' in out.stdout, out.stderr
        members = cluster.etcd.procs
        cluster.kill_node(0)
        members[0].wait(timeout=10)
        assert [m.poll() is None for m in members] == [False, True, True]
        check = (
            "from trainaccel.resilience.etcd_store import EtcdStore; "
            f"s = EtcdStore({cluster.store!r}, 'job'); s.set('k', 'v'); print(s.get('k').decode())"
        )
        out = subprocess.run([*cluster.exec_prefix(1), sys.executable, "-c", check], capture_output=True, text=True)
        assert out.stdout.strip() == "v", out.stderr  # two members of three: the store goes on
        cluster.etcd.revive()  # as the bench does between runs: the killed member back, with its data
        assert [m.poll() is None for m in cluster.etcd.procs] == [True, True, True]
        assert all(cluster.etcd.health(k) for k in range(3))
    assert namespaces("tatest-etcd-") == []


@pytest.mark.parametrize("node_cpus", ["0.67", "2", "1.5"])
def test_parse_node_cpus(monkeypatch, node_cpus):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    spec = f"nodes=3,procs-per-node=1,link=500mbit,node-cpus={node_cpus}"
    assert parse_emulate(spec) == Emulation(3, 1, "500mbit", float(node_cpus))


@pytest.mark.parametrize("node_cpus", ["0", "-1", "2.5", "fast", "0.05", "nan"])
def test_bad_node_cpus_names_the_value_and_what_is_accepted(monkeypatch, node_cpus):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"invalid --emulate .*C the cores each node may use \(> 0, at most 2"):
        parse_emulate(f"nodes=3,procs-per-node=1,link=500mbit,node-cpus={node_cpus}")


@pytest.mark.parametrize("node_cpus,procs,threads", [(0.67, 1, 1), (4, 2, 2), (8, 1, 8), (1, 2, 1)])
def test_capped_nodes_give_their_workers_their_own_cores(monkeypatch, node_cpus, procs, threads):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert Emulation(3, procs, "1gbit", node_cpus).threads_per_worker == threads


@pytest.mark.parametrize(
    "cpus,nodes,procs,threads", [(2, 2, 1, 1), (2, 3, 1, 1), (16, 2, 2, 4), (16, 3, 1, 5), (1, 2, 2, 1)]
)
def test_each_worker_gets_its_share_of_the_cores(monkeypatch, cpus, nodes, procs, threads):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    emulation = Emulation(nodes, procs, "1gbit")
    assert emulation.threads_per_worker == threads
    env = emulation.node_env({"PATH": "/bin", "GLOO_SOCKET_IFNAME": "lo"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "eth0"}
    assert emulation.node_env({"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7", "the user's own setting is kept"


def _bits_per_s(cluster: EmulatedCluster, sender_node: int, receiver_node: int, nbytes: int) -> float:
    receiver = subprocess.Popen(
        [*cluster.exec_prefix(receiver_node), sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert receiver.stdout.readline().strip() == "ready"
        subprocess.run(
            [
                *cluster.exec_prefix(sender_node),
                sys.executable,
                "-c",
                SENDER,
                cluster.address(receiver_node),
                str(nbytes),
            ],
            check=True,
            timeout=60,
        )
        return float(receiver.communicate(timeout=60)[0].strip())
    finally:
        receiver.kill()


@pytest.mark.multiprocess  # ip netns, and a process per node
@needs_netns
def test_link_is_shaped_between_nodes_and_not_within_a_node():
    emulation = parse_emulate("nodes=2,procs-per-node=1,link=40mbit")
    with EmulatedCluster(emulation, prefix="tatest-link-") as cluster:
        across = _bits_per_s(cluster, 0, 1, 4_000_000)
        within = _bits_per_s(cluster, 1, 1, 4_000_000)
    assert 0.5 * 40e6 <= across <= 1.25 * 40e6, across
    assert within >= 10 * 40e6, within
    assert namespaces("tatest-link-") == []


CAPPED = """
import sys, time
cgroup = next(line.split(":")[2] for line in open("/proc/self/cgroup") if line.split(":")[1] in ("cpu", "cpu,cpuacct", ""))
end = time.monotonic() + 0.5
while time.monotonic() < end:
    pass
print(cgroup.strip())
"""


@pytest.mark.multiprocess  # ip netns, cgroups, a process per node
@needs_netns
@pytest.mark.skipif(cpu_cgroup_root() is None, reason="needs a CPU cgroup tree")
def test_node_cpus_runs_each_node_in_a_cgroup_capped_at_its_cores_and_removes_them():
    root, version = cpu_cgroup_root()
    with EmulatedCluster(parse_emulate("nodes=2,procs-per-node=1,link=1gbit,node-cpus=0.5"), "tatest-cpu-") as cluster:
        for node in (0, 1):
            out = subprocess.run(
                [*cluster.exec_prefix(node), sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0, out.stderr
            path = os.path.join(root, f"tatest-cpu-n{node}")
            assert out.stdout.strip() == f"/tatest-cpu-n{node}", "a child of the command runs in its node's cgroup"
            if version == 1:
                quota = [open(os.path.join(path, f)).read().strip() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us")]
            else:
                quota = open(os.path.join(path, "cpu.max")).read().split()
            assert quota == ["5000", "10000"], quota
            stat = dict(line.split() for line in open(os.path.join(path, "cpu.stat")))
            assert int(stat["nr_throttled"]) > 0, f"half a second of busy loop at half a core was never held: {stat}"
    assert glob.glob(os.path.join(root, "tatest-cpu-*")) == [], "the node cgroups are removed"
    assert namespaces("tatest-cpu-") == []


@pytest.mark.multiprocess
@needs_netns
def test_no_namespace_survives_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [
            *trainaccel_cmd(),
            "bench",
            "train",
            "--model",
            "mlp",
            "--steps",
            "50",
            "--warmup",
            "1",
            "--repeats",
            "3",
            "--batch-size",
            "2",
            "--emulate",
            "nodes=2,procs-per-node=1,link=100mbit",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background (`cmd &`) inherits SIGINT ignored; a user's Ctrl-C is not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    prefix = f"ta{proc.pid}-"
    deadline = time.monotonic() + 60
    while not namespaces(prefix) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert namespaces(prefix), "the benchmark never built its namespaces"
    time.sleep(2)  # let the workers start inside them
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert namespaces(prefix) == [], f"namespaces left behind: {namespaces(prefix)}"


def test_emulate_without_root_says_what_is_needed(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="--emulate needs root and iproute2"):
        with EmulatedCluster(parse_emulate("nodes=2,procs-per-node=1,link=1gbit"), prefix="tatest-noroot-"):
            pass


@pytest.mark.bench_full
@pytest.mark.multiprocess
@needs_netns
def test_bench_train_on_an_emulated_cluster_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.Popen(
        [
            *trainaccel_cmd(),
            "bench",
            "train",
            "--model",
            "mlp",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "2",
            "--arms",
            "baseline,trainaccel",
            "--compression",
            "bf16",
            "--emulate",
            "nodes=2,procs-per-node=1,link=1gbit",
            "--json",
            out,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    assert namespaces(f"ta{proc.pid}-") == []
    report = json.loads(out.read_text())
    assert report["settings"]["emulate"] == "nodes=2,procs-per-node=1,link=1gbit"
    assert report["arms"]["baseline"]["comm_hook"] is None
    assert report["arms"]["trainaccel"]["comm_hook"] == "trainaccel_comm_hook"
    assert report["arms"]["trainaccel"]["bytes_per_step"] == report["arms"]["baseline"]["bytes_per_step"] / 2


def test_a_failed_build_raises_its_own_error_and_says_what_teardown_left(monkeypatch, capsys):
    from trainaccel.bench import emulate

    def build(self):
        raise ValueError("the build failed")

    def teardown(self):
        raise emulate.EmulationError("could not remove the node cgroup /x: busy")

    monkeypatch.setattr(emulate, "why_not_emulated", lambda: None)
    monkeypatch.setattr(EmulatedCluster, "_build", build)
    monkeypatch.setattr(EmulatedCluster, "teardown", teardown)
    with pytest.raises(ValueError, match="the build failed"):
        with EmulatedCluster(parse_emulate("nodes=2,procs-per-node=1,link=1gbit"), prefix="tatest-fail-"):
            pass
    assert "trainaccel: could not remove the node cgroup /x: busy" in capsys.readouterr().err
