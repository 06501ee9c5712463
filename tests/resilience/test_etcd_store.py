"""The job's store on etcd (resilience/etcd_store.py) against a real 3-member etcd cluster on loopback: c10d's Store
interface alike with TCPStore's, Gloo's rendezvous over it, and what it does when members go: the leader killed, a
waiter's member killed, a reply lost after its write was applied, a majority lost."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainaccel.bench.stores import EtcdCluster, free_port
from trainaccel.config import parse_endpoints
from trainaccel.resilience.etcd_store import EtcdStore

# Without etcd on the PATH, EtcdCluster fails naming the package (tools/install-test-servers installs it); without the
# etcd extra, EtcdStore names it.

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    members = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    yield members
    members.close()


@pytest.fixture
def own_cluster(tmp_path):
    """A cluster of the test's own, for a test that kills members."""
    members = EtcdCluster(tmp_path)
    yield members
    members.close()


def test_store_answers_as_tcpstore_does(cluster, request):
    """Every operation of c10d's Store, one sequence on a real TCPStore and on the etcd store: the same answers."""
    tcp = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=2))
    etcd = EtcdStore(cluster.url, request.node.name, timeout=timedelta(seconds=2))

    def answers(store):
        seen = []
        store.set("a", "1")
        store.set("b", b"\x00\xffbytes")
        seen += [store.get("a"), store.get("b")]
        seen += [store.add("n", 5), store.add("n", -2), store.add("n", 0), store.add("fresh", 0)]
        seen += [store.compare_set("c", "", "first"), store.compare_set("c", "", "second")]
        seen += [store.compare_set("c", "first", "third"), store.compare_set("c", "wrong", "x")]
        seen += [store.compare_set("missing", "expected", "x")]  # TCPStore's answer: the expected value
        seen += [store.check(["a", "n"]), store.check(["a", "nowhere"])]
        store.append("log", "ab")
        store.append("log", "cd")
        seen += [store.get("log")]
        store.multi_set(["m1", "m2"], ["x", b"y"])
        seen += [store.multi_get(["m1", "m2"])]
        seen += [store.delete_key("m1"), store.delete_key("m1"), store.check(["m1"])]
        seen += [store.num_keys()]
        with pytest.raises(dist.DistStoreError):
            store.wait(["never"], timedelta(seconds=0.5))
        return seen

    etcd_answers = answers(etcd)
    # TCPStore counts a key of its own (the workers' count at start) in num_keys.
    tcp_answers = answers(tcp)
    tcp_answers[-1] -= 1
    assert etcd_answers == tcp_answers


def test_jobs_sharing_a_cluster_do_not_see_each_other(cluster):
    one, two = EtcdStore(cluster.url, "job-one"), EtcdStore(cluster.url, "job-two")
    one.set("k", "1")
    two.add("counter", 3)
    assert not two.check(["k"]) and not one.check(["counter"])
    assert one.num_keys() == 1 and two.num_keys() == 1


def test_gloo_groups_rendezvous_over_it_and_get_waits_for_a_late_key(cluster, request):
    store = EtcdStore(cluster.url, request.node.name)
    results = {}

    def rank(r):
        group = dist.ProcessGroupGloo(dist.PrefixStore("g/", store), r, 3, timedelta(seconds=30))
        t = torch.tensor([float(r + 1)])
        group.allreduce([t]).wait()
        results[r] = t.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: 6.0, 1: 6.0, 2: 6.0}

    threading.Timer(0.5, lambda: store.clone().set("late", "here")).start()
    start = time.monotonic()
    assert store.get("late") == b"here"
    assert 0.4 < time.monotonic() - start < 5


def test_the_leader_killed_the_store_goes_on_and_a_waiter_moves_to_a_live_member(own_cluster):
    store = EtcdStore(own_cluster.url, "job")
    store.set("before", "1")
    leader = own_cluster.leader()
    store._member = leader  # the requests go to the member about to die  # noqa: SLF001
    waited = {}

    def waiter():
        start = time.monotonic()
        waited["value"] = store.clone().get("after")
        waited["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    own_cluster.kill(leader)
    assert store.add("count", 2) == 2
    store.set("after", "2")
    thread.join(30)
    assert waited["value"] == b"2" and waited["seconds"] < 15
    assert store.get("before") == b"1"
    assert own_cluster.leader() != leader


class ReplyDropper:
    """A TCP proxy before one member that, once armed, lets the next transaction through and closes the connection
    before its reply: the write is applied, the client hears nothing."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            txn = threading.Event()
            threading.Thread(target=self.pipe, args=(client, upstream, txn, True), daemon=True).start()
            threading.Thread(target=self.pipe, args=(upstream, client, txn, False), daemon=True).start()

    def pipe(self, source, sink, txn, outbound):
        try:
            while data := source.recv(65536):
                if outbound and b"POST /v3/kv/txn" in data and self.armed.is_set():
                    txn.set()
                if not outbound and txn.is_set():
                    self.armed.clear()
                    txn.clear()
                    self.dropped += 1
                    return  # the finally below ends both sides at once (shutdown wakes the other pipe too)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self):
        self.server.close()


def test_an_add_whose_reply_was_lost_is_applied_once(own_cluster):
    """The write reaches the cluster, its reply is lost with the connection: the retry finds the write's receipt."""
    client_port = own_cluster.ports[0][0]
    dropper = ReplyDropper(client_port)
    try:
        others = [(host, port) for host, (port, _) in zip(own_cluster.hosts, own_cluster.ports)][1:]
        store = EtcdStore([("127.0.0.1", dropper.port), *others], "job")
        store._member = 0  # through the proxy  # noqa: SLF001
        assert store.add("n", 1) == 1
        dropper.armed.set()
        store._member = 0  # noqa: SLF001
        assert store.add("n", 10) == 11
        assert dropper.dropped == 1
        assert EtcdStore(own_cluster.url, "job").add("n", 0) == 11  # not 21: applied once
        dropper.armed.set()
        store._member = 0  # noqa: SLF001
        store.append("log", "x")
        assert dropper.dropped == 2 and store.get("log") == b"x"
    finally:
        dropper.close()


def test_a_majority_lost_ends_requests_with_one_line_naming_the_store(own_cluster):
    store = EtcdStore(own_cluster.url, "job", unavailable_s=3)
    store.set("k", "v")
    own_cluster.kill(0)
    own_cluster.kill(1)
    start = time.monotonic()
    with pytest.raises(dist.DistNetworkError) as raised:  # as a TCPStore's lost server: not a wait's timeout
        store.get("k")
    message = str(raised.value)
    assert "\n" not in message
    assert f"the job's store ({store.describe()}) did not answer for 3 s" in message
    assert 3 <= time.monotonic() - start < 3 + 2 * 8 + 2  # the window, then at most the request under way


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:2379", "invalid store 'http://h:2379'"),
        ("etcd://", "invalid store 'etcd://'"),
        ("etcd://h1:2379,h2", "invalid store member 'h2'"),
        ("etcd://h1:0", "invalid store member 'h1:0'"),
        ("etcd://h1:2379,h1:2379", "a member is named twice"),
    ],
)
def test_bad_store_addresses_are_refused_naming_the_value(url, says):
    with pytest.raises(ValueError, match="accepted: etcd://HOST:PORT") as raised:
        parse_endpoints(url)
    assert says in str(raised.value)


def test_store_addresses_parse():
    assert parse_endpoints("etcd://10.0.0.1:2379,[::1]:2380,h:1") == [("10.0.0.1", 2379), ("::1", 2380), ("h", 1)]


def test_a_cluster_chooses_its_ports_again_when_another_process_took_one(tmp_path, monkeypatch):
    """A port chosen free and taken before etcd binds it (another test's connection): the cluster starts on others."""
    import trainaccel.bench.stores as stores

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    choices = [[busy, *stores.listen_ports(5)]]
    real = stores.listen_ports
    monkeypatch.setattr(stores, "listen_ports", lambda count: choices.pop() if choices else real(count))
    try:
        members = EtcdCluster(tmp_path)
    finally:
        taken.close()
    try:
        assert busy not in [port for pair in members.ports for port in pair]
        assert not choices and all(members.health(k) for k in range(3))
    finally:
        members.close()


def test_listen_ports_are_distinct_and_below_the_ephemeral_range():
    from trainaccel.bench.stores import listen_ports

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = listen_ports(50)
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)
