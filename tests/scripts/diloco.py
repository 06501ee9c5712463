"""A plain DDP script (no trainaccel import while training) run under `sync_every`, checked against DiLoCo computed
by hand: every rank replays all replicas in-process (inner AdamW, outer Nesterov SGD on the mean change).

Run with TRAINACCEL_SYNC_EVERY=3 and TRAINACCEL_SYNC_SCOPE=rank or node (and optionally TRAINACCEL_SYNC_FRAGMENTS=3,
TRAINACCEL_SYNC_OVERLAP=1) on 2 emulated nodes x 2 workers; each rank writes OUT_DIR/rank{r}.json. Under node scope
a replica is a node's: its gradient is the mean of its 2 workers' gradients.
"""

import copy
import hashlib
import io
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

H, LR, OUTER_LR, OUTER_MOMENTUM = 3, 0.01, 0.7, 0.9
# Streaming, when the environment asks for it: sync_fragments and sync_overlap as trainaccel reads them.
F = int(os.environ.get("TRAINACCEL_SYNC_FRAGMENTS", "1"))
TAU = int(os.environ.get("TRAINACCEL_SYNC_OVERLAP", "0"))
PER_NODE = 2 if os.environ["TRAINACCEL_SYNC_SCOPE"] == "node" else 1  # workers that share one replica
FRAGMENTS = {1: [[0, 1, 2, 3]], 3: [[0], [1], [2, 3]]}[F]  # net()'s 4 tensors (96, 16, 48, 3 values) split by size


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def digest(module: nn.Module) -> str:
    """The synced model's digest (state_dict() holds it): the same on every rank, at any step."""
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def any_digest(module: nn.Module) -> str:
    """The live parameters' digest (this rank's replica), whatever their dtype (numpy has no bfloat16)."""
    return hashlib.sha256(flat(module).float().numpy().tobytes()).hexdigest()


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def reference(world: int, steps: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """DiLoCo by hand: `world` / PER_NODE replicas, each stepping on its workers' mean gradient (DDP's: each halved,
    then summed); fragment f's outer Nesterov step every H steps from step (f + 1) H / F, applied TAU steps later
    with the steps taken meanwhile kept on top. Returns each replica and the synced model (the applied anchors).
    """
    start = net(seed)
    world //= PER_NODE  # replicas
    replicas = [copy.deepcopy(start) for _ in range(world)]
    inners = [torch.optim.AdamW(m.parameters(), lr=LR) for m in replicas]
    anchor = [p.detach().clone() for p in start.parameters()]
    outers = [
        torch.optim.SGD([anchor[i] for i in group], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        for group in FRAGMENTS
    ]
    synced = [a.clone() for a in anchor]  # what looks see: the anchors of the syncs applied so far
    pending: dict = {}  # fragment -> (step it is applied at, each replica's parameters when its sync began)

    def apply(f: int) -> None:
        _, then = pending.pop(f)
        for i in FRAGMENTS[f]:
            synced[i] = anchor[i].detach().clone()
        for m, before in zip(replicas, then):
            for i in FRAGMENTS[f]:
                p = list(m.parameters())[i]
                p.copy_((p - before[i]) + anchor[i])

    def begin(f: int, step: int) -> None:
        for i in FRAGMENTS[f]:
            anchor[i].grad = sum((anchor[i] - list(m.parameters())[i]) / world for m in replicas)
        outers[f].step()
        pending[f] = (step + TAU, [{i: list(m.parameters())[i].clone() for i in FRAGMENTS[f]} for m in replicas])
        if TAU == 0:
            apply(f)

    for step in range(1, steps + 1):
        for r, (m, opt) in enumerate(zip(replicas, inners)):
            grads = []
            for worker in range(r * PER_NODE, (r + 1) * PER_NODE):
                x, y = batch(worker, step)
                opt.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            if PER_NODE > 1:
                for p, worker_grads in zip(m.parameters(), zip(*grads)):
                    p.grad = sum(g / PER_NODE for g in worker_grads)
            opt.step()
        with torch.no_grad():
            for f in [f for f in sorted(pending) if pending[f][0] <= step]:
                apply(f)
            for f in range(F):
                offset = (f + 1) * H // F
                if step >= offset and (step - offset) % H == 0:
                    begin(f, step)
    return [flat(m) for m in replicas], torch.cat([s.reshape(-1) for s in synced])


def train(model: DDP, optimizer: torch.optim.Optimizer, rank: int, first: int, last: int, look_at=(), hashes=None):
    for step in range(first, last + 1):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if look_at == "every step":  # a running metric: an evaluation forward on every rank at every step
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        elif step in look_at:
            model.module.eval()  # a look: changes nothing
            model.train()
        # Right after a sync of the whole model every replica is the synced model; at a look, the synced model.
        if hashes is not None and step % H == 0 and F == 1 and TAU == 0:
            hashes.append([step, any_digest(model.module)])
        elif hashes is not None and step in look_at:
            hashes.append([step, digest(model.module)])


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank}

    # 1. Exact: 8 steps, a look at step 5, an end that is not a sync; looks change nothing and see the synced model.
    model = DDP(net(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    hashes: list = []
    train(model, optimizer, rank, 1, 8, look_at=(5, 8), hashes=hashes)
    grad = model.module[0].weight.grad
    replicas, synced = reference(world, 8, seed=0)
    result["exact_err"] = float((flat(model.module) - replicas[rank // PER_NODE]).abs().max())
    seen = torch.cat([t.reshape(-1) for t in model.module.state_dict().values()])
    result["synced_err"] = float((seen - synced).abs().max())
    result["moved"] = float((replicas[0] - flat(net(0))).abs().max())  # how far training took the parameters
    result["hashes"] = hashes
    result["grad"] = hashlib.sha256(grad.numpy().tobytes()).hexdigest()  # its own (node scope: its node's)
    # The same run with an evaluation forward on every rank at every step: the same replica, nothing sent more.
    model = DDP(net(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, optimizer, rank, 1, 8, look_at="every step")
    result["metric_forward_err"] = float((flat(model.module) - replicas[rank // PER_NODE]).abs().max())
    result["metric_forward_bytes"] = model.trainaccel.diloco.bytes_sent

    # 2. Rank 0 alone saves (then every rank meets in a barrier) and evaluates: no wait, no average, the synced model.
    model = DDP(net(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, optimizer, rank, 1, 4)
    if rank == 0:
        result["subset_look"] = digest(model.module)
        torch.save(model.state_dict(), io.BytesIO())
        model.eval()
        with torch.no_grad():
            model(batch(0, 0)[0])
        model.train()
    started = time.perf_counter()
    dist.barrier()
    result["barrier_s"] = time.perf_counter() - started
    result["every_rank_look"] = digest(model.module)
    train(model, optimizer, rank, 5, 6)  # step 6 syncs
    result["after_subset_look"] = digest(model.module)

    # 2b. An EMA as torchvision's reference scripts keep one: a copy in eval mode, the model still training.
    ema = copy.deepcopy(model.module)
    ema.eval()
    result["ema_modes"] = [ema.training, model.module.training, model.training]
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.module.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
        ema(batch(rank, 7)[0])
    train(model, optimizer, rank, 7, 7)
    result["ema_finite"] = all(bool(p.isfinite().all()) for p in ema.parameters())

    # 3. GradScaler skipping a step on rank 1 only still counts it: syncs stay aligned, nothing hangs.
    model = DDP(net(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(1, 7):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss * (float("inf") if (rank == 1 and step == 2) else 1.0)).backward()
        scaler.step(optimizer)
        scaler.update()
    result["after_skip"] = digest(model.module)

    # 3b. A step the script skips on rank 1 only (`if not finite: continue`) counts: the syncs stay aligned, the end
    # comes without a wait.
    model = DDP(net(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(1, 8):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if rank == 1 and step == 2:
            continue
        optimizer.step()
    optimizer.zero_grad()
    result["after_script_skip"] = [digest(model.module), model.trainaccel.diloco.steps, model.trainaccel.diloco.syncs]

    # 4. BatchNorm statistics averaged; find_unused_parameters needs nothing more without the per-step exchange.
    for options in ({"find_unused_parameters": False}, {"find_unused_parameters": True}):
        torch.manual_seed(3)
        module = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
        model = DDP(module, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        train(model, optimizer, rank, 1, 3)  # step 3 syncs
        result[f"bn/{options['find_unused_parameters']}"] = digest(model.module)
        result[f"bn_mean/{options['find_unused_parameters']}"] = model.module[1].running_mean.tolist()

    # 5. Kill and resume: a checkpoint at step 3 (a sync) resumed to step 9 equals the run itself (all but streaming,
    # whose replicas are never the synced model: each resumes from it).
    model = DDP(net(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, optimizer, rank, 1, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    train(model, optimizer, rank, 4, 9)
    uninterrupted = flat(model.module)
    resumed = DDP(net(5))  # another start: everything comes from the checkpoint
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=LR)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    train(resumed, resumed_optimizer, rank, 4, 9)
    result["resume_err"] = float((flat(resumed.module) - uninterrupted).abs().max())

    # 7. sync_every=auto (explicit, on a plain module): every rank picks the same interval from the slowest figures.
    from trainaccel.comm import DiLoCo

    module = net(7)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    auto = DiLoCo(module, optimizer, sync_every="auto")
    for step in range(1, 13):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
    result["auto"] = [auto.interval, auto.syncs, auto.next_sync]

    # 8. The script's own communication hook: under node scope this model falls back to one replica per rank.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = DDP(net(8))
    model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, optimizer, rank, 1, 2)
    result["own_hook_grad"] = hashlib.sha256(model.module[0].weight.grad.numpy().tobytes()).hexdigest()
    train(model, optimizer, rank, 3, 3)  # step 3 syncs
    result["own_hook"] = digest(model.module)

    # 9. Node scope keeps DDP's exchange (in the node), so DDP's static_graph trains (rank scope refuses it).
    if PER_NODE > 1:
        model = DDP(net(9), static_graph=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        train(model, optimizer, rank, 1, 3)  # step 3 syncs
        result["static_graph"] = digest(model.module)

    # 10. Models users have: a sparse embedding (SGD), pure fp16 (SGD with momentum) and pure bf16 (AdamW) parameters.
    for kind in ("sparse", "fp16", "bf16"):
        if kind == "sparse":
            torch.manual_seed(10)
            module = nn.Sequential(nn.EmbeddingBag(40, 6, mode="sum", sparse=True), nn.Linear(6, 3))
        else:
            module = net(10).to(torch.float16 if kind == "fp16" else torch.bfloat16)
        start = any_digest(module)
        model = DDP(module)
        if kind == "bf16":
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        else:  # (AdamW's eps underflows in float16, with or without trainaccel)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(1, 5):  # step 3 syncs
            x, y = batch(rank, step)
            x = (x.abs() * 6).long().clamp(max=39) if kind == "sparse" else x.to(module[0].weight.dtype)
            loss = nn.functional.mse_loss(model(x).float(), y)
            optimizer.zero_grad()
            loss.backward()
            if step == 1:
                grad = module[-1].weight.grad.float()
                result[f"kind/{kind}/grad"] = hashlib.sha256(grad.numpy().tobytes()).hexdigest()
            optimizer.step()
        result[f"kind/{kind}"] = digest(module)  # the synced model
        result[f"kind/{kind}/moved"] = result[f"kind/{kind}"] != start
        result[f"kind/{kind}/finite"] = all(bool(p.isfinite().all()) for p in module.parameters())

    # 11. Two optimizers (a recommender's: AdamW for the dense layers, SparseAdam for a sparse embedding): an inner
    # step ends once both stepped, so right after a sync step the replicas are equal with no look.
    torch.manual_seed(11)
    module = nn.Sequential(nn.EmbeddingBag(40, 6, mode="sum", sparse=True), nn.Linear(6, 3))
    model = DDP(module)
    optimizers = [
        torch.optim.AdamW(module[1].parameters(), lr=LR),
        torch.optim.SparseAdam(module[0].parameters(), lr=LR),
    ]
    for step in range(1, 2 * H + 1):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model((x.abs() * 6).long().clamp(max=39)), y)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        if step % H == 0:
            result[f"two_optimizers/{step}"] = any_digest(module)  # flat(), not state_dict(): no look
    result["two_optimizers/look"] = digest(module)  # the synced model (streaming's fragments too)

    # 6. The end: destroy_process_group() applies the syncs in flight; sync_replicas() averages the last steps.
    from trainaccel.comm import sync_replicas

    model = DDP(net(6))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, optimizer, rank, 1, 4)
    sync_replicas(model)
    result["end_live"] = any_digest(model.module)
    dist.destroy_process_group()
    result["end"] = digest(model.module)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
