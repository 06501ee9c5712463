"""Input pipelines: images packed into indexed TFRecord shards, read with verified random access.

Needs the `data` extra (`pip install 'trainaccel[data]'`): crc32c, protobuf and Pillow.
"""

from trainaccel.data.dataset import RecordDataset
from trainaccel.data.example import ImageRecord, decode_example, encode_example
from trainaccel.data.records import (
    CorruptRecordError, RecordFile, RecordWriter, build_index, index_path, masked_crc, read_index, write_index,
)  # fmt: skip
from trainaccel.data.sampler import ShardSampler

__all__ = [
    "CorruptRecordError", "ImageRecord", "RecordDataset", "RecordFile", "RecordWriter", "ShardSampler", "build_index", "decode_example",
    "encode_example", "index_path", "masked_crc", "read_index", "write_index",
]  # fmt: skip
