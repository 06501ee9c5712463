"""Each rank reads a remote pack through ShardSampler and a 2-worker DataLoader, stops mid-epoch, and resumes in a new job.

Argv: OUT_DIR URL PHASE. Phase `first`: read epoch 1 whole (the reference), then again for 2
batches, and save the sampler's state as a checkpoint would. Phase `second` (new processes):
load that state and read the rest. What a rank records is the dataset index of each record it
read. The ranks of a node share the block cache $CACHE_ROOT/node<N>.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainaccel.data import RecordDataset, ShardSampler

out_dir, url, phase = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
cache = Path(os.environ["CACHE_ROOT"]) / f"node{os.environ['GROUP_RANK']}"
dataset = RecordDataset(url, output="bytes", cache_dir=cache, block_size="4KB")


class Indexed(torch.utils.data.Dataset):
    """Reads record i (bytes and CRCs through the remote cache) and yields i."""

    def __len__(self) -> int:
        return len(dataset)

    def __getitem__(self, i: int) -> int:
        image, _ = dataset[i]
        assert isinstance(image, bytes) and image
        return i


def labels(sampler: ShardSampler, batches: int | None = None) -> list[int]:
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=3, sampler=sampler, num_workers=2, collate_fn=list)
    seen = []
    for number, batch in enumerate(loader):
        if number == batches:
            break  # the loader has fetched ahead; only what the loop used counts
        seen += batch
    return seen


checkpoint = out_dir / f"checkpoint{rank}.json"
if phase == "first":
    sampler = ShardSampler(dataset, seed=7, window=5)  # ranks and world size from the process group
    sampler.set_epoch(1)
    full = labels(sampler)
    interrupted = labels(sampler, batches=2)
    state = sampler.state_dict(consumed=len(interrupted))
    checkpoint.write_text(json.dumps({"sampler": state, "full": full, "interrupted": interrupted, "pid": os.getpid()}))
else:
    saved = json.loads(checkpoint.read_text())
    resumed = ShardSampler(dataset, seed=7, window=5)
    resumed.load_state_dict(saved["sampler"])
    rest = labels(resumed)
    result = {
        "full": saved["full"],
        "interrupted": saved["interrupted"],
        "rest": rest,
        "resumed_in_new_process": saved["pid"] != os.getpid(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
