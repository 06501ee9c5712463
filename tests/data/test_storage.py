"""Remote-storage pieces that need no server: sizes, block plans, the shared block cache, and bad arguments."""

import time

import numpy as np
import pytest

from trainaccel.data import RecordDataset
from trainaccel.data.storage import BlockCache, is_url, local_path, parse_bytes, plan_blocks

CLOSED = "http://127.0.0.1:1/pack"  # nothing listens there: arguments are checked before any request


def test_urls_sizes_and_block_plans():
    assert is_url("s3://b/p") and is_url("https://h/p") and not is_url("/data/p") and not is_url("file:///data/p")
    assert str(local_path("file:///data/p")) == "/data/p"
    assert parse_bytes("8MB", "x") == 8_000_000 and parse_bytes("2KiB", "x") == 2048 and parse_bytes(512, "x") == 512
    assert parse_bytes("1.5GB", "x") == 1_500_000_000
    index = np.array([[0, 100], [100, 300], [400, 50], [450, 500], [950, 10]])
    assert plan_blocks(index, 350).tolist() == [0, 2, 4]  # each block at least 350 bytes, whole records
    assert plan_blocks(index, 1).tolist() == [0, 1, 2, 3, 4]
    assert plan_blocks(index, 10**9).tolist() == [0]
    assert plan_blocks(np.zeros((0, 2), dtype=np.int64), 10).tolist() == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": "0"}, "invalid block_size='0'; accepted: bytes as a number or with a unit"),
        ({"block_size": "8 parsecs"}, "invalid block_size='8 parsecs'"),
        ({"cache_limit": True}, "invalid cache_limit=True"),
        ({"prefetch": -1}, r"invalid prefetch=-1; accepted: an integer >= 0 \(threads reading ahead\)"),
        ({"retries": -1}, "invalid retries=-1; accepted: an integer >= 0"),
        ({"timeout": 0}, r"invalid timeout=0; accepted: seconds > 0"),
    ],
)
def test_bad_remote_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecordDataset(CLOSED, **kwargs)


def test_unknown_protocols_and_missing_backends_say_what_to_install():
    with pytest.raises(ValueError, match="cannot open nosuch:// URLs"):
        RecordDataset("nosuch://bucket/pack")
    with pytest.raises(
        ImportError, match=r"reading gs:// URLs needs fsspec and its backend: pip install 'trainaccel\[gcs\]'"
    ):
        RecordDataset("gs://bucket/pack")


def test_the_block_cache_shares_blocks_and_evicts_least_recent_shards(tmp_path):
    cache = BlockCache(tmp_path / "c", limit=250, prefetch=0)
    fetched = []

    def fetcher(data):
        return lambda: fetched.append(data) or data

    assert bytes(cache.block("k/a", 0, fetcher(b"a" * 100), list)) == b"a" * 100
    assert bytes(cache.block("k/a", 0, fetcher(b"never"), list)) == b"a" * 100  # mapped: not fetched again
    assert bytes(BlockCache(tmp_path / "c", limit=250).block("k/a", 0, fetcher(b"never"), list)) == b"a" * 100
    cache.block("k/b", 0, fetcher(b"b" * 100), list)
    cache.block("k/c", 0, fetcher(b"c" * 100), list)  # 300 > 250: the least recently used shard goes, whole
    assert sorted(p.name for p in (tmp_path / "c" / "k").iterdir()) == ["b", "c"]
    assert fetched == [b"a" * 100, b"b" * 100, b"c" * 100]
    # Read-ahead: what the reader lists (the shard's other blocks, then the next shard's) on background threads.
    ahead = BlockCache(tmp_path / "d", prefetch=2)
    ahead.block(
        "k/s",
        0,
        fetcher(b"0"),
        lambda: [("k/s", 1, fetcher(b"1")), ("k/s", 2, fetcher(b"2")), ("k/t", 0, fetcher(b"3"))],
    )
    deadline = time.monotonic() + 10
    while len(list((tmp_path / "d" / "k").glob("*/block-??????"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    ahead.close()
    assert sorted(
        p.relative_to(tmp_path / "d" / "k").as_posix() for p in (tmp_path / "d" / "k").glob("*/block-??????")
    ) == [
        "s/block-000000",
        "s/block-000001",
        "s/block-000002",
        "t/block-000000",
    ]
    temporary = BlockCache()
    folder = temporary.folder
    assert folder.is_dir()
    del temporary
    assert not folder.exists()  # a cache without a folder of its own is removed with its owner
