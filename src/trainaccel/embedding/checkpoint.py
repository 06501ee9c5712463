"""Checkpoints of sharded tables in safetensors files, loadable at any world size (they reshard on load).

A checkpoint is a directory: `meta.json` (format, world size, sharding, tables) and one
`shard-RRRRR-of-WWWWW.safetensors` per rank holding that rank's keys, rows, optimizer state and
counters as `<table>/<field>` tensors. Loading reads every shard and keeps the keys this rank owns now.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from trainaccel.embedding.sharded import ShardedEmbeddingCollection

FORMAT = "trainaccel.embedding.sharded/1"
_NEEDS = "embedding checkpoints need safetensors: pip install 'trainaccel[embedding]'"
_SCALARS = ("step",)


def _shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def _barrier(collection: ShardedEmbeddingCollection) -> None:
    if collection.world > 1:
        dist.barrier(group=collection.group)


def save(collection: ShardedEmbeddingCollection, directory: str | os.PathLike) -> Path:
    """Write this rank's shards (every rank calls it); returns the directory."""
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(_NEEDS) from e

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{name}/{field}": value.detach().cpu().contiguous()
        for name, shard in collection.shards.items()
        for field, value in shard.export().items()
    }
    target = directory / _shard_file(collection.rank, collection.world)
    partial = target.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={"format": FORMAT})
    os.replace(partial, target)  # a reader never sees half a shard
    if collection.rank == 0:
        meta = {
            "format": FORMAT,
            "world_size": collection.world,
            "sharding": collection.sharding,
            "placement": collection.placement,
            "tables": {name: {"dim": collection.dim(name)} for name in collection.names},
        }
        (directory / "meta.json").write_text(json.dumps(meta, indent=2))
    _barrier(collection)
    return directory


def _read_meta(collection: ShardedEmbeddingCollection, directory: Path) -> dict:
    path = directory / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"no embedding checkpoint at {directory}: {path.name} is missing")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}; accepted: {FORMAT!r}")
    saved = {name: t["dim"] for name, t in meta["tables"].items()}
    wanted = {name: collection.dim(name) for name in collection.names}
    if saved != wanted:
        raise ValueError(f"{directory}: the checkpoint has tables {saved}, this collection {wanted} (name: dim)")
    missing = [_shard_file(r, meta["world_size"]) for r in range(meta["world_size"])]
    missing = [f for f in missing if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: shard files missing: {', '.join(missing)}")
    return meta


def load(collection: ShardedEmbeddingCollection, directory: str | os.PathLike) -> None:
    """Fill this rank's shards from a checkpoint written at any world size and sharding."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(_NEEDS) from e

    directory = Path(directory)
    meta = _read_meta(collection, directory)
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {name: {} for name in collection.shards}
    scalars: dict[str, dict[str, float]] = {name: {} for name in collection.shards}
    for rank in range(meta["world_size"]):
        with safe_open(str(directory / _shard_file(rank, meta["world_size"])), framework="pt") as f:
            names = set(f.keys())
            for table in collection.shards:
                fields = sorted(n.split("/", 1)[1] for n in names if n.startswith(table + "/"))
                for prefix in ("", "pending_"):
                    if prefix + "keys" not in fields:
                        continue
                    keys = f.get_tensor(f"{table}/{prefix}keys")
                    mine = collection.owners(table, keys) == collection.rank
                    for field in fields:
                        aligned = field.startswith("pending_") if prefix else not field.startswith("pending_")
                        if aligned and field not in _SCALARS and not field.startswith("scalar."):
                            pieces[table].setdefault(field, []).append(f.get_tensor(f"{table}/{field}")[mine])
                for field in fields:
                    if field in _SCALARS or field.startswith("scalar."):
                        value = float(f.get_tensor(f"{table}/{field}"))
                        scalars[table][field] = max(value, scalars[table].get(field, value))
    for table, shard in collection.shards.items():
        data = {field: torch.cat(parts) for field, parts in pieces[table].items()}
        data.setdefault("keys", torch.empty(0, dtype=torch.int64))
        data.setdefault("weight", torch.empty(0, shard.dim))
        data.update({field: torch.tensor(value) for field, value in scalars[table].items()})
        data["step"] = torch.tensor(int(scalars[table].get("step", 0)))
        shard.load(data)
    _barrier(collection)
