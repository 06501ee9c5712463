"""TFRecord shards: framing and index checked against the `tfrecord` package, and corruption caught."""

import pickle

import pytest
import torch
from tfrecord.reader import tfrecord_loader
from tfrecord.tools.tfrecord2idx import create_index
from tfrecord.writer import TFRecordWriter

from conftest import worker_loader
from trainaccel.data import (
    CorruptRecordError,
    ImageRecord,
    RecordFile,
    RecordWriter,
    build_index,
    decode_example,
    encode_example,
    read_index,
)

DESCRIPTION = {"image/encoded": "byte", "image/class/label": "int", "image/filename": "byte"}


def images(n: int = 5) -> list[ImageRecord]:
    """Records of different sizes (so offsets differ), with bytes that are not valid UTF-8."""
    return [
        ImageRecord(bytes([255, i]) * (10 + 7 * i), label=i % 3, height=4, width=6, filename=f"c{i % 3}/{i}.jpg")
        for i in range(n)
    ]


def write_shard(path, records) -> None:
    with RecordWriter(path) as writer:
        for record in records:
            writer.write(record.to_example())


def test_round_trip_and_index_match_the_tfrecord_package(tmp_path):
    shard = tmp_path / "a.tfrecord"
    write_shard(shard, images())
    shard_file = RecordFile(shard)
    assert [ImageRecord.from_example(p) for p in shard_file] == images()
    create_index(str(shard), str(tmp_path / "theirs.index"))
    assert (tmp_path / "theirs.index").read_text() == (tmp_path / "a.tfrecord.index").read_text()
    assert (read_index(tmp_path / "a.tfrecord.index") == build_index(shard)).all()


def test_the_tfrecord_package_reads_our_shards_record_for_record(tmp_path):
    shard = tmp_path / "a.tfrecord"
    write_shard(shard, images())
    theirs = list(tfrecord_loader(str(shard), None, DESCRIPTION))
    assert [(r["image/encoded"], int(r["image/class/label"][0]), r["image/filename"].decode()) for r in theirs] == [
        (i.encoded, i.label, i.filename) for i in images()
    ]
    # Through our index, in whatever order it yields them.
    indexed = list(tfrecord_loader(str(shard), str(tmp_path / "a.tfrecord.index"), DESCRIPTION))
    assert sorted(r["image/filename"] for r in indexed) == sorted(i.filename.encode() for i in images())


def test_we_read_shards_the_tfrecord_package_wrote(tmp_path):
    shard = tmp_path / "theirs.tfrecord"
    writer = TFRecordWriter(str(shard))
    for image in images():
        writer.write(
            {
                "image/encoded": (image.encoded, "byte"),
                "image/class/label": (image.label, "int"),
                "image/filename": (image.filename.encode(), "byte"),
            }
        )
    writer.close()
    create_index(str(shard), str(tmp_path / "theirs.index"))
    for index in (None, tmp_path / "theirs.index"):  # built by scanning, or theirs
        got = [ImageRecord.from_example(p) for p in RecordFile(shard, index)]
        assert [(g.encoded, g.label, g.filename) for g in got] == [(i.encoded, i.label, i.filename) for i in images()]


@pytest.mark.parametrize("where, message", [(12 + 5, "payload CRC mismatch"), (2, "length CRC mismatch")])
def test_a_flipped_byte_names_shard_record_and_offset(tmp_path, where, message):
    shard = tmp_path / "a.tfrecord"
    write_shard(shard, images())
    offset, _ = (int(x) for x in read_index(tmp_path / "a.tfrecord.index")[3])
    data = bytearray(shard.read_bytes())
    data[offset + where] ^= 0x01
    shard.write_bytes(bytes(data))
    records = RecordFile(shard)
    assert ImageRecord.from_example(records[2]) == images()[2]  # the others still read
    with pytest.raises(CorruptRecordError, match=rf"a.tfrecord: record 3 at offset {offset}: {message}"):
        records[3]
    if message.startswith("payload"):  # verify=False hands the damaged payload over unchecked
        damaged, original = RecordFile(shard, verify=False)[3], images()[3].to_example()
        assert len(damaged) == len(original) and damaged != original


def test_truncated_shard_and_bad_index(tmp_path):
    shard = tmp_path / "a.tfrecord"
    write_shard(shard, images())
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(CorruptRecordError, match=r"record 4 at offset \d+ is truncated"):
        RecordFile(shard)[4]
    with pytest.raises(CorruptRecordError, match=r"record 4 at offset \d+ is truncated"):
        build_index(shard)
    (tmp_path / "bad.index").write_text("0 10\n12\n")
    with pytest.raises(ValueError, match="every line of an index must be `offset size`"):
        RecordFile(shard, tmp_path / "bad.index")


def test_an_interrupted_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with RecordWriter(tmp_path / "a.tfrecord") as writer:
            writer.write(b"one")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


class _Payloads(torch.utils.data.Dataset):
    def __init__(self, records: RecordFile):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> int:
        return ImageRecord.from_example(self.records[i]).label


@pytest.mark.multiprocess  # DataLoader workers
def test_a_record_file_goes_to_dataloader_workers(tmp_path):
    shard = tmp_path / "a.tfrecord"
    write_shard(shard, images(12))
    records = RecordFile(shard)
    records[0]  # opened here first: the workers must map the file themselves
    assert pickle.loads(pickle.dumps(records))._map is None
    loader = worker_loader(_Payloads(records), batch_size=3)
    assert torch.cat(list(loader)).tolist() == [i.label for i in images(12)]


def test_example_encoding_types_and_errors():
    payload = encode_example({"b": b"x", "s": "y", "i": [1, 2], "f": 0.5, "mixed": [1, 2.5]})
    assert decode_example(payload) == {"b": [b"x"], "s": [b"y"], "i": [1, 2], "f": [0.5], "mixed": [1.0, 2.5]}
    with pytest.raises(ValueError, match=r"feature 'bad' has values of types \['bytes', 'int'\]"):
        encode_example({"bad": [b"x", 1]})
    with pytest.raises(ValueError, match="not an image record"):
        ImageRecord.from_example(encode_example({"label": 1}))
