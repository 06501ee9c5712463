"""Real servers for the benches and the tests: nginx over a folder, moto's S3 server, an etcd cluster."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trainaccel.config import store_url

NGINX_CONF = """
{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format ranges '$uri $http_range $status';
    access_log {prefix}/access.log ranges;
    sendfile on;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    types {{ application/json json; }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def free_port() -> int:
    """A port for a server of ours to listen on (see listen_ports)."""
    return listen_ports(1)[0]


def listen_ports(count: int) -> list[int]:
    """`count` distinct ports free now, below the kernel's ephemeral range: a port from bind(0) is one that any
    outgoing connection (another test's Gloo pair) may take as its own before a server started later binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in random.sample(range(max(1024, low - 12000), low), min(count * 20, 2000)):
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free ports below {low} on 127.0.0.1")


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = log.read_text() if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before opening port {port}: {detail}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not open port {port} in 30 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Nginx:
    """nginx serving `root` read-only over HTTP on a free loopback port (range requests included)."""

    def __init__(self, root: Path, prefix: Path):
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).exists():
            raise RuntimeError(
                "nginx is not installed; the remote-data tests serve shards with it "
                "(Debian, Ubuntu: apt-get install nginx-light)"
            )
        prefix.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.port = free_port()
        conf = prefix / "nginx.conf"
        # As root, nginx's workers would run as nobody, who cannot read pytest's private temporary folders.
        user = "user root;" if os.geteuid() == 0 else ""
        conf.write_text(NGINX_CONF.format(user=user, prefix=prefix, port=self.port, root=root))
        self.proc = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        _wait_for_port(self.port, self.proc, "nginx", prefix / "error.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = prefix / "access.log"

    def requests(self) -> list[tuple[str, str, str]]:
        """(path, Range header or "-", status) of every request served so far."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [tuple(line.split(" ", 2)) for line in lines]

    def close(self) -> None:
        _stop(self.proc)


class MotoS3:
    """moto's standalone S3 server (as s3fs's own tests use), with one bucket; `options` are s3fs's storage options."""

    def __init__(self, bucket: str = "trainaccel"):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait_for_port(self.port, self.proc, "moto_server")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}
        # The same settings as environment variables, for commands that take no options (`trainaccel pack`).
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **self.options).mkdir(bucket)

    def close(self) -> None:
        _stop(self.proc)


class EtcdCluster:
    """An etcd cluster (Debian's etcd-server, or any etcd >= 3.4 on the PATH) of one member per host in `hosts`.

    On loopback (the default: `members` members on 127.0.0.1) each member takes free ports; on hosts of their own
    (emulated nodes' addresses, each member started through its node's `prefixes` entry) the usual 2379 and 2380.
    `url` is the store's address for `trainaccel`: etcd://HOST:PORT,... .
    """

    def __init__(
        self,
        scratch: Path,
        members: int = 3,
        hosts: list[str] | None = None,
        prefixes: list[list[str]] | None = None,
        token: str = "trainaccel",
    ):
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError(
                "etcd is not installed; the replicated store's tests and benches start a cluster of it "
                "(Debian, Ubuntu: apt-get install etcd-server)"
            )
        self.binary, self.scratch, self.token = binary, scratch, token
        self.hosts = hosts or ["127.0.0.1"] * members
        self.prefixes = prefixes or [[] for _ in self.hosts]
        self.names = [f"m{k}" for k in range(len(self.hosts))]
        self.procs: list[subprocess.Popen | None] = [None] * len(self.hosts)
        for attempt in range(3):
            if hosts is None:
                ports = listen_ports(2 * len(self.hosts))
                self.ports = list(zip(ports[::2], ports[1::2]))
            else:
                self.ports = [(2379, 2380)] * len(self.hosts)
            self.initial = ",".join(
                f"{name}=http://{host}:{peer}" for name, host, (_, peer) in zip(self.names, self.hosts, self.ports)
            )
            self.url = store_url((host, client) for host, (client, _) in zip(self.hosts, self.ports))
            try:
                for k in range(len(self.hosts)):
                    self.start(k, state="new")
                self.wait_healthy()
                return
            except BaseException as err:
                self.close()
                # another process took a port between the choice and etcd's bind: choose again, from scratch
                if hosts is not None or attempt == 2 or "address already in use" not in str(err):
                    raise
                for name in self.names:
                    shutil.rmtree(self.scratch / f"etcd-{name}", ignore_errors=True)

    def start(self, k: int, state: str = "existing") -> None:
        """Start member `k` (again: with its data, it rejoins the cluster)."""
        host, (client, peer) = self.hosts[k], self.ports[k]
        data = self.scratch / f"etcd-{self.names[k]}"
        data.mkdir(parents=True, exist_ok=True)
        log = open(self.scratch / f"etcd-{self.names[k]}.log", "a")  # noqa: SIM115 (the member's own file)
        self.procs[k] = subprocess.Popen(
            [
                *self.prefixes[k],
                self.binary,
                f"--name={self.names[k]}",
                f"--data-dir={data}",
                f"--listen-client-urls=http://{host}:{client}",
                f"--advertise-client-urls=http://{host}:{client}",
                f"--listen-peer-urls=http://{host}:{peer}",
                f"--initial-advertise-peer-urls=http://{host}:{peer}",
                f"--initial-cluster={self.initial}",
                f"--initial-cluster-state={state}",
                f"--initial-cluster-token={self.token}",
                "--log-level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def _request(self, k: int, path: str, data: bytes | None = None) -> bytes | None:
        """Member `k`'s answer to `path` (a POST of `data`, if any), asked from where it listens (its node's
        namespace under an emulation); None if it does not answer."""
        host, (client, _) = self.hosts[k], self.ports[k]
        url = f"http://{host}:{client}{path}"
        if not self.prefixes[k]:
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=2) as reply:
                    return reply.read()
            except OSError:
                return None
        ask = (
            "import sys, urllib.request\n"
            "data = sys.argv[2].encode() if len(sys.argv) > 2 else None\n"
            "sys.stdout.buffer.write(urllib.request.urlopen(urllib.request.Request(sys.argv[1], data=data), "
            "timeout=2).read())\n"
        )
        command = [*self.prefixes[k], sys.executable, "-c", ask, url, *([data.decode()] if data is not None else [])]
        try:
            done = subprocess.run(command, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return None
        return done.stdout if done.returncode == 0 else None

    def health(self, k: int) -> bool:
        """Whether member `k` answers and sees a leader."""
        return b'"health":"true"' in (self._request(k, "/health") or b"")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for k, proc in enumerate(self.procs):
            while proc is not None and not self.health(k):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.scratch / f"etcd-{self.names[k]}.log").read_text()[-2000:]
                    raise RuntimeError(f"etcd member {self.names[k]} is not healthy (exit {proc.poll()}): {log}")
                time.sleep(0.1)

    def leader(self) -> int:
        """The index of the member that leads now."""
        import json

        for k, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                continue
            reply = self._request(k, "/v3/maintenance/status", b"{}")
            status = json.loads(reply) if reply else {}
            if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return k
        raise RuntimeError("no etcd member leads")

    def revive(self) -> None:
        """Every member that was killed started again (with its data: it rejoins), then all healthy."""
        for k, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                self.start(k)
        self.wait_healthy()

    def kill(self, k: int) -> None:
        """Member `k` killed outright (SIGKILL), as when its node is lost."""
        proc = self.procs[k]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for k in range(len(self.procs)):
            self.kill(k)


class Remote:
    """A folder served on loopback by nginx (`http`) or moto's S3 server (`s3`, uploaded), behind a delaying proxy.

    `url(path)` is the URL of a file or folder under `folder`; `options` are fsspec's storage options.
    """

    def __init__(self, kind: str, folder: Path, scratch: Path, latency_ms: float = 0.0, upload: list[Path] = ()):
        self.kind, self.folder = kind, folder
        self.servers: list = []
        if kind == "http":
            server = Nginx(folder, scratch / "nginx")
            self.servers.append(server)
        elif kind == "s3":
            server = MotoS3()
            self.servers.append(server)
            import s3fs

            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.options)
            for path in upload:  # moto keeps objects in memory: only what the arms read
                fs.put(f"{path}/", f"{server.bucket}/{path.relative_to(folder).as_posix()}", recursive=True)
        else:
            raise ValueError(f"invalid store {kind!r}; accepted: http, s3")
        self.proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainaccel.bench.netproxy",
                "--upstream",
                f"127.0.0.1:{server.port}",
                "--delay-ms",
                str(latency_ms),
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        port = int(self.proxy.stdout.readline())
        self.base = f"http://127.0.0.1:{port}"
        self.options: dict = {}
        if kind == "s3":
            self.options = {**server.options, "endpoint_url": self.base}
            self.base = f"s3://{server.bucket}"

    def url(self, path: Path) -> str:
        return f"{self.base}/{Path(path).relative_to(self.folder).as_posix()}"

    def close(self) -> None:
        _stop(self.proxy)
        for server in self.servers:
            server.close()

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
