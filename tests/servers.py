"""The storage servers of the remote-data tests (nginx, moto's S3 server), started as marked tests must."""

from __future__ import annotations

from pathlib import Path

from conftest import require_multiprocess
from trainaccel.bench import stores


class Nginx(stores.Nginx):
    def __init__(self, root: Path, prefix: Path):
        require_multiprocess("nginx")
        super().__init__(root, prefix)


class MotoS3(stores.MotoS3):
    def __init__(self, bucket: str = "trainaccel"):
        require_multiprocess("moto_server")
        super().__init__(bucket)
