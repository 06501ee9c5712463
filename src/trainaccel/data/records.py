"""TFRecord shards: framing with masked CRC32C, the `offset size` index, and verified random access.

A record is `uint64 length | uint32 masked_crc(length) | payload | uint32 masked_crc(payload)`,
little-endian, as TensorFlow writes it. The index beside a shard has one `offset size` line per
record (size covers the whole framed record), the text format DALI and the `tfrecord` package read.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

_HEADER = struct.Struct("<QI")  # length, masked CRC of the length
_FOOTER = struct.Struct("<I")  # masked CRC of the payload
OVERHEAD = _HEADER.size + _FOOTER.size


class CorruptRecordError(ValueError):
    """A record whose framing or checksum is wrong; the message names shard, record and offset."""


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's checksum: CRC32C rotated right by 15 bits plus a constant, so CRCs of CRCs stay strong."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(payload: bytes) -> bytes:
    """One framed record."""
    header = struct.pack("<Q", len(payload))
    return header + struct.pack("<I", masked_crc(header)) + payload + _FOOTER.pack(masked_crc(payload))


def index_path(shard: str | Path) -> Path:
    """Where a shard's index lives: beside it, with `.index` added."""
    return Path(f"{shard}.index")


class RecordWriter:
    """Append framed records to a shard; written to a temporary file and renamed into place on close.

    The index is written beside the shard (also atomically). An exception inside `with` leaves no shard.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tmp = self.path.with_name(f".{self.path.name}.partial")
        self._file = open(self._tmp, "wb")
        self.entries: list[tuple[int, int]] = []

    def write(self, payload: bytes) -> tuple[int, int]:
        """Append one record; returns its (offset, size) as the index stores them."""
        record = frame(payload)
        offset = self._file.tell()
        self._file.write(record)
        self.entries.append((offset, len(record)))
        return offset, len(record)

    @property
    def bytes_written(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        write_index(index_path(self.path), self.entries)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop what was written: no shard and no index appear."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_index(path: str | Path, entries: list[tuple[int, int]]) -> None:
    """Write an `offset size` index atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text("".join(f"{offset} {size}\n" for offset, size in entries))
    os.replace(tmp, path)


def read_index(path: str | Path) -> np.ndarray:
    """An index file as an (n, 2) int64 array of offset and size."""
    return parse_index(Path(path).read_text(), path)


def parse_index(text: str, name: str | Path) -> np.ndarray:
    """An index's text (`offset size` lines) as an (n, 2) int64 array; errors name `name`."""
    try:
        rows = [tuple(int(x) for x in line.split()) for line in text.splitlines() if line.strip()]
    except ValueError as error:
        raise ValueError(f"{name}: not an `offset size` index ({error})") from None
    if any(len(row) != 2 for row in rows):
        raise ValueError(f"{name}: every line of an index must be `offset size`")
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def build_index(shard: str | Path) -> np.ndarray:
    """Scan a shard's record headers (checking each length's CRC) and return its index."""
    with open(shard, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(shard) else b""
    return scan_index(data, shard)


def scan_index(data: bytes | mmap.mmap, shard: str | Path) -> np.ndarray:
    """The index of a whole shard's bytes, found by walking its record headers; errors name `shard`."""
    entries = []
    offset, number = 0, 0
    while offset < len(data):
        length = _check_header(data, offset, shard, number)
        size = OVERHEAD + length
        if offset + size > len(data):
            raise CorruptRecordError(
                f"{shard}: record {number} at offset {offset} is truncated ({len(data) - offset} of {size} bytes)"
            )
        entries.append((offset, size))
        offset += size
        number += 1
    return np.array(entries, dtype=np.int64).reshape(-1, 2)


def _check_header(
    data: bytes | mmap.mmap | memoryview, at: int, shard: str | Path, number: int, offset: int | None = None
) -> int:
    """The record length at `at` in `data`, CRC checked; `offset` is the record's place in the shard, for messages."""
    offset = at if offset is None else offset
    if at + _HEADER.size > len(data):
        raise CorruptRecordError(f"{shard}: record {number} at offset {offset} is truncated (no complete header)")
    length, stored = _HEADER.unpack_from(data, at)
    if masked_crc(data[at : at + 8]) != stored:
        raise CorruptRecordError(
            f"{shard}: record {number} at offset {offset}: length CRC mismatch "
            f"(the length field or its checksum is damaged)"
        )
    return length


class RecordFile:
    """Random access to one shard's payloads through its index: a memory map, or a remote source's blocks.

    The map is opened lazily in each process, so a RecordFile can go to DataLoader workers.
    With `verify=True` (the default) each read checks both CRCs. `source` (a remote shard's reader,
    see `trainaccel.data.storage`) serves the bytes instead of a local file; `shard` is then its URL.
    """

    def __init__(
        self,
        shard: str | Path,
        index: str | Path | np.ndarray | None = None,
        verify: bool = True,
        source: Any = None,
    ):
        self.source = source
        if source is not None:
            if not isinstance(index, np.ndarray):
                raise ValueError(f"a remote shard ({shard}) needs its index as an array")
            self.shard: str | Path = str(shard)
            self.index = index
        else:
            self.shard = Path(shard)
            if not self.shard.is_file():
                raise FileNotFoundError(f"no shard at {self.shard}")
            if isinstance(index, np.ndarray):
                self.index = index
            elif index is not None:
                self.index = read_index(index)
            elif index_path(self.shard).is_file():
                self.index = read_index(index_path(self.shard))
            else:
                self.index = build_index(self.shard)
        self.verify = verify
        self._map: mmap.mmap | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.index)

    def _data(self) -> mmap.mmap:
        if self._map is None or self._pid != os.getpid():
            with open(self.shard, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._pid = os.getpid()
        return self._map

    def framed(self, number: int) -> tuple[int, memoryview]:
        """Record `number` as stored (header, payload, footer) and its offset, unchecked."""
        if not -len(self) <= number < len(self):
            raise IndexError(f"record {number} out of range: {self.shard} has {len(self)} records")
        offset, size = (int(x) for x in self.index[number])
        if self.source is not None:
            return offset, self.source.read(number % len(self), offset, size)
        data = self._data()
        if offset + size > len(data):
            raise CorruptRecordError(
                f"{self.shard}: record {number} at offset {offset} is truncated "
                f"(the index says {size} bytes; the shard has {len(data) - offset})"
            )
        return offset, memoryview(data)[offset : offset + size]

    def __getitem__(self, number: int) -> bytes:
        offset, record = self.framed(number)
        size = len(record)
        length = (
            _check_header(record, 0, self.shard, number, offset) if self.verify else _HEADER.unpack_from(record, 0)[0]
        )
        if OVERHEAD + length != size:
            raise CorruptRecordError(
                f"{self.shard}: record {number} at offset {offset}: the index says {size} "
                f"bytes, the record header {OVERHEAD + length}"
            )
        payload = record[_HEADER.size : _HEADER.size + length]
        if self.verify:
            (stored,) = _FOOTER.unpack_from(record, _HEADER.size + length)
            if masked_crc(payload) != stored:
                raise CorruptRecordError(
                    f"{self.shard}: record {number} at offset {offset}: payload CRC mismatch "
                    f"(stored {stored:#010x}, computed {masked_crc(payload):#010x})"
                )
        return bytes(payload)

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self)))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_map"], state["_pid"] = None, -1  # each process maps the file itself
        return state
