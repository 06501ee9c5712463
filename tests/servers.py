"""Real storage servers for the remote-data tests: nginx (Debian's package) over a folder, and moto's S3 server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_port, require_multiprocess

NGINX_CONF = """
{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format ranges '$uri $http_range $status';
    access_log {prefix}/access.log ranges;
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
        require_multiprocess("nginx")
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).exists():
            raise RuntimeError(
                "nginx is not installed; the remote-data tests serve shards with it "
                "(Debian: apt-get install nginx-light, or run tools/install-test-servers)"
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
        require_multiprocess("moto_server")
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
