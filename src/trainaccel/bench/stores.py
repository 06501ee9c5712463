"""Real storage servers on loopback for `bench data --store` and the tests: nginx over a folder, moto's S3 server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
