"""Each rank reads a RecordDataset through ShardSampler and a 2-worker DataLoader; it writes what it saw.

Labels equal dataset indices, so the labels a rank receives are the samples it read.
Argv: OUT_DIR SHARD_GLOB. Per rank: two full epochs, then epoch 2 stopped after 2 batches,
resumed from state_dict() in a fresh sampler and loader.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainaccel.data import RecordDataset, ShardSampler

out_dir, shards = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
dataset = RecordDataset(shards, output="bytes", target_transform=int)


def labels(sampler: ShardSampler, batches: int | None = None) -> list[int]:
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=3, sampler=sampler, num_workers=2, collate_fn=lambda batch: [label for _, label in batch]
    )
    seen = []
    for number, batch in enumerate(loader):
        if number == batches:
            break  # the loader has fetched ahead; only what the loop used counts
        seen += batch
    return seen


sampler = ShardSampler(dataset, seed=7, window=5)  # ranks and world size from the process group
epochs = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    epochs.append(labels(sampler))
sampler.set_epoch(2)
full = labels(sampler)
interrupted = labels(sampler, batches=2)
state = sampler.state_dict(consumed=len(interrupted))
resumed = ShardSampler(dataset, seed=7, window=5)
resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would store it
rest = labels(resumed)
Path(out_dir, f"rank{rank}.json").write_text(
    json.dumps(
        {
            "world": dist.get_world_size(),
            "epochs": epochs,
            "full": full,
            "interrupted": interrupted,
            "rest": rest,
        }
    )
)
dist.destroy_process_group()
