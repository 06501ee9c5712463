"""One arm of `trainaccel bench train --model deepfm|wide_deep`: a recommender's training loop on synthetic Criteo.

Arms: baseline (per-feature nn.EmbeddingBag with dense gradients, all of it under DDP: what a PyTorch user
writes first), trainaccel (a dynamic table row-sharded over the workers with SparseAdagrad, the dense layers
under DDP). Both use Adagrad at the same learning rate.
"""

# No `from __future__ import annotations`: DDP checks hook annotations at runtime (see bench.worker).

import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainaccel.bench.recsys import RECSYS_MODELS, CriteoSynthetic, baseline_embedding, feature_keys
from trainaccel.bench.worker import arm_arguments, job_peak_memory, start_process_group, timed_steps
from trainaccel.comm import bytes_per_step, bytes_sent
from trainaccel.compiler import is_compiled

ARMS = ("baseline", "trainaccel")
LR = 0.01


class KeyedEmbedding(nn.Module):
    """Ids [B, 26] -> one key per (feature, id) -> rows of one sharded dynamic table, [B, 26, dim]."""

    def __init__(self, table: nn.Module):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(feature_keys(ids))


def build(arm: str, model: str, dim: int, data: CriteoSynthetic, device: torch.device):
    """(DDP model, dense optimizer, sparse optimizer or None, embedding collection or None)."""
    if arm == "baseline":
        net = RECSYS_MODELS[model](dim, baseline_embedding(data.cardinalities, dim + 1)).to(device)
        collection = None
    else:
        from trainaccel.embedding import ShardedEmbeddingCollection, initializers

        collection = ShardedEmbeddingCollection(
            {"features": {"dim": dim + 1, "initializer": initializers.normal(std=0.01)}}
        )
        net = RECSYS_MODELS[model](dim, KeyedEmbedding(collection["features"])).to(device)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    dense = torch.optim.Adagrad(ddp.parameters(), lr=LR)
    if collection is None:
        return ddp, dense, None, None
    from trainaccel.embedding import SparseAdagrad

    return ddp, dense, SparseAdagrad(collection, lr=LR), collection


def main() -> None:
    parser = arm_arguments(ARMS)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--max-rows", type=int, required=True)
    args = parser.parse_args()

    device = start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = CriteoSynthetic(seed=0, max_rows=args.max_rows)
    batches = [[t.to(device) for t in data.batch(args.batch_size, rank * 1000 + i)] for i in range(4)]
    torch.manual_seed(0)
    model, dense_opt, sparse_opt, collection = build(args.arm, args.model, args.dim, data, device)

    def step(i: int) -> torch.Tensor:
        dense, sparse, labels = batches[i % len(batches)]
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        if sparse_opt is not None:
            sparse_opt.step()
        return loss

    sent_before, embedding_sent_before = 0, 0

    def on_start() -> None:
        nonlocal sent_before, embedding_sent_before
        sent_before = bytes_sent(model)
        embedding_sent_before = collection.bytes_sent if collection is not None else 0

    elapsed, loss = timed_steps(step, args.steps, args.warmup, device, on_start)
    peak = job_peak_memory(device)
    rows = torch.tensor(len(collection) if collection is not None else 0, device=device)
    dist.all_reduce(rows)

    if rank == 0:
        timed = args.steps - args.warmup
        embedding_bytes = (collection.bytes_sent - embedding_sent_before) / timed if collection is not None else 0.0
        result = {
            "arm": args.arm,
            "world_size": world,
            "examples_per_s_per_worker": args.batch_size * timed / elapsed,
            "step_time_s": elapsed / timed,
            "bytes_per_step": bytes_per_step(model, sent_before, timed) + embedding_bytes,
            "embedding_bytes_per_step": embedding_bytes,
            "peak_memory_bytes": peak,
            "comm_hook": model._get_ddp_logging_data().get("comm_hook") or None,
            "parameters": sum(p.numel() for p in model.parameters()),
            "embedding_rows": int(rows) if collection is not None else sum(data.cardinalities),
            "final_loss": loss.item(),
            "amp": None,
            "compiled": is_compiled(model),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    time.sleep(0.05)  # release the GIL before Gloo's teardown (see bench.worker)
    model = dense_opt = sparse_opt = collection = None  # as in bench.worker
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
