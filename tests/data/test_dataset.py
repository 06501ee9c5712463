"""RecordDataset over packs and foreign shards, and ShardSampler's partition, shuffle and resume."""

import io

import pytest
import torch
from PIL import Image
from tfrecord.writer import TFRecordWriter

from conftest import SCRIPTS, read_ranks, run, trainaccel_cmd, worker_loader
from trainaccel.data import CorruptRecordError, ImageRecord, RecordDataset, RecordWriter, ShardSampler
from trainaccel.data.pack import PackOptions, folder_items, pack


def jpeg(colour, size=(80, 60)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "JPEG", quality=95)
    return out.getvalue()


def write_shards(folder, shards=4, per_shard=6):
    """shard k holds records k*per_shard .. : label = dataset index, so reads can be traced."""
    folder.mkdir(exist_ok=True)
    for k in range(shards):
        with RecordWriter(folder / f"part-{k}.tfrecord") as writer:
            for j in range(per_shard):
                i = k * per_shard + j
                writer.write(ImageRecord(jpeg((i * 10 % 256, 0, 0)), i, "jpeg", 60, 80, f"{i}.jpg").to_example())
    return folder


class _Indices(torch.utils.data.Dataset):
    """The label of each record is its index: what a loader yields is what was read."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i][1]


def test_outputs_decode_size_and_random_access(tmp_path):
    folder = write_shards(tmp_path / "s")
    pil = RecordDataset(folder / "*.tfrecord")
    assert len(pil) == 24 and pil.locate(13) == (2, 1)
    image, label = pil[13]
    assert label == 13 and image.size == (80, 60) and image.mode == "RGB"
    tensor, _ = RecordDataset(folder / "*.tfrecord", output="tensor")[13]
    assert tensor.dtype == torch.uint8 and tensor.shape == (3, 60, 80) and abs(int(tensor[0, 0, 0]) - 130) <= 3
    raw, _ = RecordDataset(folder / "*.tfrecord", output="bytes")[-1]
    assert raw == jpeg((230, 0, 0))
    small, _ = RecordDataset(folder / "*.tfrecord", decode_size=(20, 15))[0]
    assert small.size == (20, 15)  # JPEG decoded at 1/4 scale
    doubled, _ = RecordDataset(folder / "*.tfrecord", transform=lambda im: im.size, target_transform=lambda y: 2 * y)[5]
    assert doubled == (80, 60) and _ == 10
    with pytest.raises(ValueError, match="invalid output='png'; accepted: pil, tensor, bytes"):
        RecordDataset(folder / "*.tfrecord", output="png")
    with pytest.raises(FileNotFoundError, match="no shards match"):
        RecordDataset(folder / "*.missing")


def test_a_pack_folder_and_foreign_shards_without_an_index(tmp_path):
    shard = tmp_path / "foreign.tfrecord"
    writer = TFRecordWriter(str(shard))
    for i in range(3):
        writer.write({"image/encoded": (jpeg((0, 50 * i, 0)), "byte"), "image/class/label": (i + 7, "int")})
    writer.close()
    dataset = RecordDataset(shard, output="bytes")  # no index beside it: built by scanning
    assert [dataset[i][1] for i in range(3)] == [7, 8, 9]
    # A pack's folder (or its manifest.json): shards in order, and the label map.
    images = tmp_path / "img"
    for c in range(2):
        (images / f"c{c}").mkdir(parents=True)
        for n in range(3):
            (images / f"c{c}" / f"{n}.jpg").write_bytes(jpeg((c * 100, n * 50, 0)))
    items, labels = folder_items(images)
    pack(items, images, tmp_path / "pack", labels, PackOptions(shard_size="4"), {"test": 1})
    for where in (tmp_path / "pack", tmp_path / "pack" / "manifest.json"):
        packed = RecordDataset(where)
        assert len(packed) == 6 and len(packed.shards) == 2 and packed.labels == {"c0": 0, "c1": 1}
        assert [packed.record(i).filename for i in range(6)] == [f"c{c}/{n}.jpg" for c in range(2) for n in range(3)]
    with pytest.raises(FileNotFoundError, match="no manifest.json in"):
        RecordDataset(images)


def test_corruption_is_reported_through_the_dataset(tmp_path):
    folder = write_shards(tmp_path / "s", shards=1)
    data = bytearray((folder / "part-0.tfrecord").read_bytes())
    data[-10] ^= 0xFF  # inside the last record's payload
    (folder / "part-0.tfrecord").write_bytes(bytes(data))
    dataset = RecordDataset(folder / "*.tfrecord", output="bytes")
    assert dataset[4][1] == 4
    with pytest.raises(CorruptRecordError, match=r"part-0.tfrecord: record 5 at offset \d+: payload CRC mismatch"):
        dataset[5]


@pytest.mark.multiprocess  # DataLoader workers
def test_two_ranks_two_workers_cover_the_epoch_once(tmp_path):
    dataset = RecordDataset(write_shards(tmp_path / "s") / "*.tfrecord", output="bytes")
    seen = []
    for rank in range(2):
        sampler = ShardSampler(dataset, num_replicas=2, rank=rank, seed=3, window=4)
        sampler.set_epoch(1)
        loader = worker_loader(_Indices(dataset), batch_size=3, sampler=sampler)
        seen.append(torch.cat(list(loader)).tolist())
    assert len(seen[0]) == len(seen[1]) == 12 and sorted(seen[0] + seen[1]) == list(range(24))
    assert seen[0] + seen[1] != list(range(24))  # shuffled
    # Shard locality: within a window of 4 the records come from at most two shards.
    order = ShardSampler(dataset, num_replicas=1, seed=3, window=4).order()
    assert all(len({i // 6 for i in order[k : k + 4]}) <= 2 for k in range(0, 24, 4))
    # Deterministic from seed and epoch; another epoch, another order.
    again = ShardSampler(dataset, num_replicas=2, rank=0, seed=3, window=4)
    again.set_epoch(1)
    assert list(again) == seen[0]
    again.set_epoch(2)
    assert list(again) != seen[0]


@pytest.mark.multiprocess
def test_two_ranks_under_trainaccel_run_cover_each_epoch_once_and_resume(tmp_path):
    shards = write_shards(tmp_path / "s", shards=5, per_shard=5)  # 25 records: rank parts padded to 13
    out = tmp_path / "out"
    out.mkdir()
    proc = run(
        [
            *trainaccel_cmd(),
            "run",
            "--standalone",
            "--nproc-per-node",
            2,
            SCRIPTS / "record_epochs.py",
            out,
            shards / "*.tfrecord",
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(out, 2)
    assert [r["world"] for r in ranks] == [2, 2]
    for epoch in range(2):
        parts = [r["epochs"][epoch] for r in ranks]
        assert len(parts[0]) == len(parts[1]) == 13
        assert sorted(set(parts[0] + parts[1])) == list(range(25))  # all of it, once, plus one padding sample
        assert len(parts[0] + parts[1]) - len(set(parts[0] + parts[1])) == 1
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # each epoch its own order
    for r in ranks:
        assert len(r["interrupted"]) == 6 and r["interrupted"] + r["rest"] == r["full"]


def test_uneven_sizes_are_padded_or_dropped(tmp_path):
    dataset = RecordDataset(write_shards(tmp_path / "s", shards=1, per_shard=5) / "*", output="bytes")
    padded = [list(ShardSampler(dataset, num_replicas=2, rank=r, shuffle=False)) for r in range(2)]
    assert padded == [[0, 1, 2], [3, 4, 0]]
    dropped = [list(ShardSampler(dataset, num_replicas=2, rank=r, shuffle=False, drop_last=True)) for r in range(2)]
    assert dropped == [[0, 1], [2, 3]]


@pytest.mark.multiprocess  # DataLoader workers
def test_resume_mid_epoch_gives_exactly_the_remaining_samples(tmp_path):
    dataset = RecordDataset(write_shards(tmp_path / "s") / "*", output="bytes")
    sampler = ShardSampler(dataset, num_replicas=2, rank=1, seed=5)
    sampler.set_epoch(4)
    full = list(sampler)
    loader = iter(worker_loader(_Indices(dataset), batch_size=2, sampler=sampler))
    consumed = [next(loader).tolist() for _ in range(2)]
    state = sampler.state_dict(consumed=4)  # what the loop used; the loader has fetched ahead
    resumed = ShardSampler(dataset, num_replicas=2, rank=1, seed=5)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full) - 4
    rest = torch.cat(list(torch.utils.data.DataLoader(_Indices(dataset), batch_size=2, sampler=resumed))).tolist()
    assert sum(consumed, []) + rest == full
    assert list(resumed) == full  # the resume point holds for one pass
    with pytest.raises(ValueError, match="this state is for seed 5 on 2 ranks"):
        ShardSampler(dataset, num_replicas=3, rank=0, seed=5).load_state_dict(state)
