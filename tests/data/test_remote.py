"""Shards on real servers: nginx over HTTP and moto's S3 server, read through fsspec, packed to S3, resumed on 2 nodes."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, read_ranks, run, run_nodes, trainaccel_cmd, worker_loader
from data.test_pack import make_images
from trainaccel.bench.netproxy import DelayProxy
from trainaccel.data import CorruptRecordError, ImageRecord, RecordDataset, RecordFile, ShardSampler
from trainaccel.data.pack import PackOptions, folder_items, pack
from trainaccel.data.storage import StorageError

pytestmark = pytest.mark.multiprocess  # servers and DataLoader workers


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory):
    """40 images in 5 shards of 8, packed locally: the reference every remote read is compared with."""
    root = tmp_path_factory.mktemp("pack")
    images = make_images(root / "img", classes=4, per_class=10, size=(96, 72))
    items, labels = folder_items(images)
    pack(items, images, root / "pack", labels, PackOptions(shard_size="8"), {"test": "local"})
    return root / "pack"


def expected(folder: Path) -> list[tuple[bytes, int, str]]:
    dataset = RecordDataset(folder, output="bytes")
    return [(*dataset[i], dataset.record(i).filename) for i in range(len(dataset))]


def served(http_server, local_pack, name: str) -> str:
    """A copy of the pack in nginx's folder under `name`; its URL."""
    shutil.copytree(local_pack, http_server.root / name)
    return f"{http_server.url}/{name}"


def uploaded(s3_server, local_pack, prefix: str) -> str:
    import s3fs

    url = f"s3://{s3_server.bucket}/{prefix}"
    s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.options).put(str(local_pack) + "/", url, recursive=True)
    return url


class _Labels(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        image, label = self.dataset[i]
        return i, image, label


def as_list(batch):
    return batch


def read_all(dataset) -> list[tuple[bytes, int]]:
    """Every record through a 2-worker DataLoader, in index order."""
    loader = worker_loader(_Labels(dataset), batch_size=5, shuffle=True, collate_fn=as_list)
    rows = sorted(row for batch in loader for row in batch)
    assert [i for i, _, _ in rows] == list(range(len(dataset)))
    return [(image, label) for _, image, label in rows]


@pytest.mark.parametrize("store", ["http", "s3"])
def test_remote_pack_reads_as_local_through_two_workers(store, http_server, s3_server, local_pack, tmp_path):
    if store == "http":
        url, options = served(http_server, local_pack, "pack-a"), {}
    else:
        url, options = uploaded(s3_server, local_pack, "pack-a"), s3_server.options
    dataset = RecordDataset(url, output="bytes", storage_options=options, block_size="4KB", cache_dir=tmp_path / "c")
    reference = expected(local_pack)
    assert len(dataset) == 40 and dataset.labels == RecordDataset(local_pack).labels
    assert read_all(dataset) == [(image, label) for image, label, _ in reference]
    assert [dataset.record(i).filename for i in range(40)] == [name for _, _, name in reference]
    pil, _ = RecordDataset(url, storage_options=options, cache_dir=tmp_path / "c")[3]
    assert pil.size == (96, 72)
    # A sampler tells the dataset its order: each shard then reads the next one of that order ahead.
    sampler = ShardSampler(dataset, num_replicas=1, rank=0, seed=4, window=8)
    sampler.set_epoch(2)
    order = [dataset.locate(i)[0] for i in sampler]
    sources = [s.source for s in dataset.shards]
    chain = [sources.index(src.next) if src.next else None for src in sources]
    visits = list(dict.fromkeys(order))
    assert [chain[a] for a in visits] == [*visits[1:], None]
    if store == "http":
        # Both workers share the cache folder: every block of every shard was downloaded exactly once.
        blocks = sum(len(s.source.starts) for s in dataset.shards)
        gets = [r for r in http_server.requests() if r[0].startswith("/pack-a/shard-") and r[0].endswith(".tfrecord")]
        assert len(gets) == blocks > 5 and len(set(gets)) == blocks
        assert all(r[1].startswith("bytes=") and r[2] == "206" for r in gets)


def test_globs_single_shards_and_shards_without_an_index(http_server, s3_server, local_pack, tmp_path):
    url = uploaded(s3_server, local_pack, "pack-b")
    reference = expected(local_pack)
    by_glob = RecordDataset(f"{url}/shard-0000[1-2]*", output="bytes", storage_options=s3_server.options)
    assert [by_glob[i] for i in range(16)] == [(image, label) for image, label, _ in reference[8:24]]
    base = served(http_server, local_pack, "pack-b")
    (http_server.root / "pack-b" / "shard-00004-of-00005.tfrecord.index").unlink()
    single = RecordDataset(f"{base}/shard-00004-of-00005.tfrecord", output="bytes", cache_dir=tmp_path / "c")
    assert [single[i] for i in range(8)] == [(image, label) for image, label, _ in reference[32:]]
    with pytest.raises(FileNotFoundError, match=r"no manifest.json under http://.*/nothing and no shard at"):
        RecordDataset(f"{http_server.url}/nothing")
    with pytest.raises(FileNotFoundError, match=r"no shards match s3://trainaccel/pack-b/none-\*"):
        RecordDataset(f"{url}/none-*", storage_options=s3_server.options)


def test_the_cache_is_bounded_by_whole_shards_and_never_serves_a_replaced_shard(http_server, local_pack, tmp_path):
    url = served(http_server, local_pack, "pack-c")
    shard_bytes = max(s["bytes"] for s in json.loads((local_pack / "manifest.json").read_text())["shards"])
    cache = tmp_path / "cache"
    dataset = RecordDataset(url, output="bytes", cache_dir=cache, cache_limit=2 * shard_bytes, block_size="4KB")
    assert read_all(dataset) == [(image, label) for image, label, _ in expected(local_pack)]  # shuffled, 2 workers
    # Within the limit, but for the shards being written (each process keeps the one it writes).
    assert sum(f.stat().st_size for f in cache.rglob("block-??????")) <= 4 * shard_bytes
    shutil.rmtree(cache)
    # One process without read-ahead, shard after shard: the eviction's unit is visible.
    dataset = RecordDataset(
        url, output="bytes", cache_dir=cache, cache_limit=2 * shard_bytes, block_size="4KB", prefetch=0
    )
    assert [dataset[i] for i in range(40)] == [(image, label) for image, label, _ in expected(local_pack)]
    kept = [p for p in cache.glob("*/*") if p.is_dir()]
    blocks = {s.source.key.rsplit("/", 1)[-1]: len(s.source.starts) for s in dataset.shards}
    assert 1 <= len(kept) <= 3  # two shards' worth, plus the one being written
    for folder in kept:  # evicted a shard at a time: what stays is whole
        assert len(list(folder.glob("block-??????"))) == blocks[folder.name]
    # The same URL now holds other records of the same sizes: the index changes, so does the cache key.
    replaced = http_server.root / "pack-c" / "shard-00000-of-00005.tfrecord"
    other = RecordFile(local_pack / "shard-00001-of-00005.tfrecord")
    shutil.copy(other.shard, replaced)
    shutil.copy(f"{other.shard}.index", f"{replaced}.index")
    manifest = json.loads((http_server.root / "pack-c" / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "replaced"
    (http_server.root / "pack-c" / "manifest.json").write_text(json.dumps(manifest))
    again = RecordDataset(url, output="bytes", cache_dir=cache, block_size="4KB")
    assert [again[i] for i in range(8)] == [RecordDataset(local_pack, output="bytes")[8 + i] for i in range(8)]


def test_network_errors_are_retried_then_name_the_shard_and_bytes(http_server, local_pack, tmp_path):
    url = served(http_server, local_pack, "pack-d")
    host, port = http_server.url.rsplit(":", 1)
    with DelayProxy(("127.0.0.1", int(port))) as proxy:
        via = f"http://127.0.0.1:{proxy.port}/pack-d"
        dataset = RecordDataset(via, output="bytes", cache_dir=tmp_path / "a", retries=3)
        proxy.refuse(2)  # the next two connections are cut as they open
        assert dataset[9] == RecordDataset(local_pack, output="bytes")[9]
        assert proxy.connections >= 3
        fresh = RecordDataset(via, output="bytes", cache_dir=tmp_path / "b", retries=2)
        proxy.refuse(100)
        with pytest.raises(StorageError) as error:
            fresh[17]
        message = str(error.value)
        assert f"reading {via}/shard-00002-of-00005.tfrecord bytes 0-" in message
        assert "(records 0 to 7): failed 3 times over" in message
    # A server that stops answering: each try ends at the timeout, then the error names the wait.
    with DelayProxy(("127.0.0.1", int(port))) as slow:
        via = f"http://127.0.0.1:{slow.port}/pack-d"
        dataset = RecordDataset(via, output="bytes", cache_dir=tmp_path / "c", timeout=0.5, retries=1)
        slow.delay = 5.0
        with pytest.raises(StorageError, match=r"failed 2 times over [0-9.]+ s, last: FSTimeoutError"):
            dataset[0]
    assert url.endswith("/pack-d")


def test_a_store_lost_mid_epoch_ends_a_two_worker_loader_with_the_error(http_server, local_pack, tmp_path):
    served(http_server, local_pack, "pack-g")
    port = int(http_server.url.rsplit(":", 1)[1])
    with DelayProxy(("127.0.0.1", port)) as proxy:
        dataset = RecordDataset(
            f"http://127.0.0.1:{proxy.port}/pack-g",
            output="bytes",
            cache_dir=tmp_path / "c",
            block_size="2KB",
            prefetch=0,  # every block on demand: the cut below meets reads still to do
            timeout=2,
            retries=1,
        )
        batches = iter(worker_loader(_Labels(dataset), batch_size=2, collate_fn=as_list))
        assert len(next(batches)) == 2
        proxy.refuse(10**6)  # the store is gone, for good
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"reading http://127.0.0.1:\d+/pack-g/shard-.* failed 2 times over"):
            for _ in batches:
                pass
        assert time.monotonic() - started < 60  # each try bounded: no worker waits forever


def test_a_damaged_remote_shard_is_reported_with_its_url(http_server, local_pack):
    url = served(http_server, local_pack, "pack-e")
    shard = http_server.root / "pack-e" / "shard-00003-of-00005.tfrecord"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF
    shard.write_bytes(bytes(data))
    dataset = RecordDataset(url, output="bytes")
    with pytest.raises(CorruptRecordError, match=rf"{url}/shard-00003-of-00005.tfrecord: record 0 at offset 0"):
        dataset[24]


def test_pack_to_s3_resumes_and_reads_back(s3_server, tmp_path):
    images = make_images(tmp_path / "img", classes=2, per_class=12, size=(120, 90))
    url = f"s3://{s3_server.bucket}/packed"
    cmd = [*trainaccel_cmd(), "pack", "imagefolder", images, url, "--shard-size", "5", "--max-side", "64"]
    proc = run(cmd, env=s3_server.env)
    assert proc.returncode == 0, proc.stderr
    assert f"{url}: 24 images in 5 shards" in proc.stdout
    local = tmp_path / "local"
    run([*trainaccel_cmd(), "pack", "imagefolder", images, local, "--shard-size", "5", "--max-side", "64"])
    remote = RecordDataset(url, output="bytes", storage_options=s3_server.options)
    records = [ImageRecord.from_example(remote.shards[0][i]) for i in range(5)]
    assert [r.width for r in records] == [64] * 5
    assert [remote[i] for i in range(24)] == [RecordDataset(local, output="bytes")[i] for i in range(24)]
    # Interrupted after two shards (their completion records are there, the manifest is not): a rerun
    # uploads the other three and writes the manifest.
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.options)
    manifest = json.loads(fs.cat_file(f"{url}/manifest.json"))
    fs.rm(f"{url}/manifest.json")
    plan = manifest["plan"]
    fs.pipe_file(f"{url}/pack-plan.json", json.dumps(plan).encode())
    for shard in manifest["shards"][:2]:
        fs.pipe_file(f"{url}/{shard['name']}.done.json", json.dumps({**shard, "skipped": []}).encode())
    for shard in manifest["shards"][2:]:
        fs.rm(f"{url}/{shard['name']}")
    proc = run(cmd, env=s3_server.env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(fs.cat_file(f"{url}/manifest.json")) == manifest
    assert not fs.glob(f"{url}/*.done.json") and not fs.exists(f"{url}/pack-plan.json")
    bad = run([*trainaccel_cmd(), "pack", "imagefolder", images, "https://host/x"])
    assert bad.returncode == 2 and "cannot pack to https://host/x: HTTP is read-only; pack to a folder" in bad.stderr


def test_two_nodes_resume_mid_epoch_from_s3_with_exactly_the_remaining_samples(s3_server, local_pack, tmp_path):
    url = uploaded(s3_server, local_pack, "pack-f")
    out = tmp_path / "out"
    out.mkdir()
    launcher = [*trainaccel_cmd(), "run"]
    env = {**s3_server.env, "CACHE_ROOT": str(tmp_path / "cache")}
    for phase in ("first", "second"):
        procs = run_nodes(SCRIPTS / "remote_resume.py", out, url, phase, per_node=2, launcher=launcher, env=env)
        for proc in procs:
            assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(out, 4)
    seen = []
    for rank in ranks:
        assert len(rank["interrupted"]) == 6 and rank["interrupted"] + rank["rest"] == rank["full"]
        assert rank["resumed_in_new_process"]
        seen += rank["full"]
    assert sorted(seen) == list(range(40))  # 4 ranks x 10: the epoch once
    # Each node's two ranks shared one cache folder: a node downloaded each shard once at most.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["node0", "node1"]
