"""Input pipelines: images packed into indexed TFRecord shards, local or remote, read with verified random access.

Needs the `data` extra (`pip install 'trainaccel[data]'`): crc32c, protobuf, Pillow and simplejpeg. Names
are imported on first use, so `trainaccel` commands start without the extra installed.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "RecordDataset": "dataset",
    "ShardSampler": "sampler",
    "ImageRecord": "example",
    "decode_example": "example",
    "encode_example": "example",
    "CorruptRecordError": "records",
    "RecordFile": "records",
    "RecordWriter": "records",
    "build_index": "records",
    "index_path": "records",
    "masked_crc": "records",
    "read_index": "records",
    "write_index": "records",
    "RandomResizedCrop": "transforms",
    "CenterCrop": "transforms",
    "StorageError": "storage",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'trainaccel.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainaccel.data.{_HOMES[name]}"), name)
