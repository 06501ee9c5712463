"""Sharded tables on real Gloo workers: train against one local table on the global batch, save, load.

Usage: sharded_embedding.py OUT_DIR train CKPT_DIR   (train both shardings, check, save the row-sharded one)
       sharded_embedding.py OUT_DIR load CKPT_DIR    (load at this world size, export what each rank holds)
"""

import sys
import warnings

import torch
import torch.distributed as dist
from checks import Checks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainaccel.embedding import DynamicEmbedding, SparseAdagrad, checkpoint, embedding_lookup_sparse
from trainaccel.embedding.sharded import ShardedEmbeddingCollection

TABLES = {"a": {"dim": 4, "admit_after": 2}, "b": 3}
SAME_DIMS = {"a": {"dim": 4, "admit_after": 2}, "b": 4}  # rows move as [n, dim] (another code path)
STEPS, BATCH = 4, 6


def batch(rank: int, step: int) -> dict:
    """Bags of keys with repeats within and across ranks, some empty."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for name, vocab in (("a", 40), ("b", 25)):
        lengths = torch.randint(0, 4, (BATCH,), generator=g)
        values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g) * 7919 - 100
        offsets = torch.cumsum(lengths, 0) - lengths
        out[name] = (values, offsets, torch.rand(values.numel(), generator=g))
    out["upstream"] = torch.randn(BATCH, 1, generator=g)
    return out


def main() -> None:
    out_dir, mode, ckpt = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks()
    if mode == "train":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DynamicEmbedding(2)(torch.tensor([1])).sum().backward()  # a plain table: each worker its own copy
            replicated = [str(w.message) for w in caught]
            ShardedEmbeddingCollection({"c": 2})({"c": torch.tensor([[1]])})  # shards: no warning
        checks.check(
            f"a plain table warns once: {replicated}",
            len(replicated) == 1 and "each worker trains its own copy" in replicated[0],
        )
        checks.check(f"shards do not warn: {[str(w.message) for w in caught]}", len(caught) == 1)
        for label, sharding, tables in (
            ("row", "row", TABLES),
            ("table", "table", TABLES),
            ("row same dims", "row", SAME_DIMS),
        ):
            collection = ShardedEmbeddingCollection(tables, sharding=sharding)
            sparse = SparseAdagrad(collection, lr=0.5)
            torch.manual_seed(0)
            width = sum(collection.dim(n) for n in tables)
            dense = DistributedDataParallel(nn.Linear(width, 1))
            dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)

            reference = {n: DynamicEmbedding(**collection.options[n]) for n in tables}
            ref_sparse = SparseAdagrad(list(reference.values()), lr=0.5)
            torch.manual_seed(0)
            ref_dense = nn.Linear(width, 1)
            ref_dense_opt = torch.optim.SGD(ref_dense.parameters(), lr=0.1 / world)  # DDP averages, the sum does not

            for step in range(STEPS):
                mine = batch(rank, step)
                pooled = collection(
                    {n: mine[n][0] for n in TABLES},
                    offsets={n: mine[n][1] for n in TABLES},
                    weights={n: mine[n][2] for n in TABLES},
                    combiner="mean",
                )
                loss = (dense(torch.cat([pooled["a"], pooled["b"]], 1)) * mine["upstream"]).sum()
                loss.backward()
                sparse.step()
                dense_opt.step()
                dense_opt.zero_grad()

                everyone = [batch(r, step) for r in range(world)]  # the global batch in one lookup per table
                ref_pooled = []
                for n in TABLES:
                    values = torch.cat([b[n][0] for b in everyone])
                    starts = torch.cumsum(torch.tensor([0] + [b[n][0].numel() for b in everyone[:-1]]), 0)
                    offsets = torch.cat([b[n][1] + s for b, s in zip(everyone, starts)])
                    weights = torch.cat([b[n][2] for b in everyone])
                    ref_pooled.append(embedding_lookup_sparse(reference[n], values, weights, "mean", offsets=offsets))
                upstream = torch.cat([b["upstream"] for b in everyone])
                (ref_dense(torch.cat(ref_pooled, 1)) * upstream).sum().backward()
                ref_sparse.step()
                ref_dense_opt.step()
                ref_dense_opt.zero_grad()

            collection.eval()
            for name, ref in reference.items():
                keys = ref.keys()
                got = collection[name](keys)
                checks.check(
                    f"{label} {name}: rows equal the single table's",
                    torch.allclose(got, ref(keys), rtol=1e-5, atol=1e-6),
                )
                held = torch.tensor([len(collection.shards[name]) if name in collection.shards else 0])
                dist.all_reduce(held)
                checks.check(
                    f"{label} {name}: {int(held)} rows held in all, {len(ref)} expected", int(held) == len(ref)
                )
                if name in collection.shards:
                    shard = collection.shards[name]
                    owned = collection.owners(name, shard.keys()) == rank
                    checks.check(f"{label} {name}: a rank holds only its own keys", bool(owned.all()))
                    ref_state = ref.row_state["sum"][ref._find_rows(shard.keys())]
                    got_state = shard.row_state["sum"][shard._find_rows(shard.keys())]
                    checks.check(
                        f"{label} {name}: Adagrad state equal",
                        torch.allclose(got_state, ref_state, rtol=1e-5, atol=1e-6),
                    )
                    pending = shard.export()["pending_keys"] if name == "a" else torch.empty(0)
                    checks.check(
                        f"{label} {name}: pending keys own", bool((collection.owners(name, pending) == rank).all())
                    )
            checks.check(
                f"{label}: dense replicas agree with the reference",
                torch.allclose(dense.module.weight, ref_dense.weight, atol=1e-6),
            )
            if label == "row":
                checkpoint.save(collection, ckpt)
                torch.save({n: s.export() for n, s in collection.shards.items()}, f"{ckpt}/truth-{rank}.pt")
    else:
        collection = ShardedEmbeddingCollection(TABLES)
        SparseAdagrad(collection, lr=0.5)
        checkpoint.load(collection, ckpt)
        torch.save({n: s.export() for n, s in collection.shards.items()}, f"{ckpt}/loaded-{world}-{rank}.pt")
        for name, shard in collection.shards.items():
            checks.check(
                f"{name}: loaded keys are owned here", bool((collection.owners(name, shard.keys()) == rank).all())
            )
        mine = batch(rank, STEPS)  # one more step runs on the resharded tables
        pooled = collection({"a": mine["a"][0]}, offsets={"a": mine["a"][1]})
        pooled["a"].sum().backward()
        SparseAdagrad(collection, lr=0.5).step()
    checks.write(out_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
