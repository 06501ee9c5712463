"""One arm of `trainaccel bench quality`: a real task trained for a fixed number of steps, validated as it goes.

Arms: baseline (plain DDP under torchrun), torch-bf16 and torch-fp16 (DDP with torch's own
`bf16_compress_hook` / `fp16_compress_hook`), trainaccel (the same script under `trainaccel run`),
local (no gradient exchange: the compute-only ceiling; its replicas drift apart, so its quality
is rank 0's alone). The clock runs during training steps only, not during validation. Under sync_every a
validation is what a script's own evaluation is: a forward without gradients in eval mode, which sees the synced
model (the last sync's) with no communication and leaves training as it was; only the last one averages the
replicas first (`sync_replicas`, on the clock), as a script does before saving its final model.

With `--lose-node N --lose-at S` the workers of node N kill themselves (SIGKILL) before step S. Under
on_lost_replica=continue the clock is rank 0's own: the slowest worker's time would need a collective over the
default group, which a lost worker would end. A worker started again to rejoin (`bench quality --rejoin`) starts its
loop after the step it joined at, its learning-rate schedule moved on as far; with `--lose-node`, every rank writes
`OUT.rank<R>` (the step it joined at, a digest of its final parameters) for the replicas to be compared.
With `--global-batch N` each worker draws N over the workers present (`trainaccel.comm.members`) at each step: the
survivors of a loss read the lost worker's share, as a script that keeps its global batch does.
With `--join-at S --join-marker F` rank 0 writes F before step S: the bench then starts a node that joins the job
(`bench quality --join`); with `--compare-replicas` every rank writes `OUT.rank<R>` as with `--lose-node`.
With `--checkpoint DIR`, rank 0 saves the job (model, optimizer, schedule, curve, clock) after each validation, the
replicas averaged, and a job started again (torchrun's --max-restarts) resumes from it: today's way back from a loss.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import argparse
import hashlib
import json
import os
import signal
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainaccel.amp import scaled
from trainaccel.bench.tasks import add_task_arguments, get_task, warmup_cosine
from trainaccel.bench.worker import (
    ARMS,
    auto_lines,
    comm_hook,
    release_process_group,
    sent_per_step,
    set_up_arm,
    start_process_group,
)
from trainaccel.comm import bytes_sent, members, rejoined_at, sync_replicas
from trainaccel.context import current_config


def share_of(global_batch: int, present: list[int], rank: int) -> int:
    """`rank`'s examples of a step's `global_batch` over the workers `present`: equal shares, the first few one more."""
    share, extra = divmod(global_batch, len(present))
    return share + (present.index(rank) < extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", choices=ARMS, required=True)
    add_task_arguments(parser)
    parser.add_argument("--lose-node", type=int, help="this node's workers kill themselves at --lose-at")
    parser.add_argument("--lose-at", type=int, help="the step before which they do")
    parser.add_argument("--join-at", type=int, help="rank 0 writes --join-marker before this step")
    parser.add_argument("--join-marker", help="the file that starts a node joining the job (bench quality --join)")
    parser.add_argument("--compare-replicas", action="store_true", help="every rank writes OUT.rank<R> at its end")
    parser.add_argument("--checkpoint", help="a folder: saved to after each validation, resumed from at a restart")
    parser.add_argument("--global-batch", type=int, help="examples per step over the workers present at each step")
    args = parser.parse_args()

    device = start_process_group()
    rank = dist.get_rank()
    task = get_task(args.task)
    train, validation = task.load()
    validation = type(validation)(validation.inputs.to(device), validation.targets.to(device))
    torch.manual_seed(args.seed)  # the same initial model on every rank and in every arm
    model = DistributedDataParallel(
        task.build().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    set_up_arm(model, args.arm)
    optimizer = scaled(task.optimizer(list(model.parameters())))  # loss scaling if trainaccel's amp=fp16
    schedule = warmup_cosine(optimizer, args.steps)
    draw = task.batches(train, args.batch_size, seed=args.seed * 1000 + rank)
    first = rejoined = rejoined_at(model)  # 0, or the step this worker, started again, rejoined the others at
    with warnings.catch_warnings():  # (torch warns of a schedule stepped before its optimizer)
        warnings.simplefilter("ignore")
        for _ in range(first):
            schedule.step()

    curve = []  # (step, seconds of training so far, validation loss, validation accuracy)
    elapsed, started = 0.0, 0.0
    config = current_config()
    said = auto_lines(config)  # sync_every=auto's choices go into the result
    own_clock = config is not None and config.on_lost_replica == "continue"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # a job started again loses nothing more
    lost_here = args.lose_node is not None and int(os.environ.get("GROUP_RANK", "0")) == args.lose_node and not attempt
    saved = os.path.join(args.checkpoint, "job.pt") if args.checkpoint else None
    if saved and os.path.exists(saved):  # the job started again: from its last checkpoint
        state = torch.load(saved, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        first, elapsed, curve = state["step"], state["elapsed"], state["curve"]

    def start_clock() -> None:
        nonlocal started
        if not own_clock:
            dist.barrier()  # every worker starts together: the clock measures the job
        started = time.perf_counter()

    def stop_clock_and_validate(step: int) -> None:
        nonlocal elapsed
        if step == args.steps:
            sync_replicas(model)  # under sync_every: the final model is the replicas' average, on the clock
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = torch.tensor(time.perf_counter() - started, device=device)
        if not own_clock:
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest worker sets the pace
        elapsed += float(took)
        loss, accuracy = task.evaluate(model.module, validation)
        curve.append([step, elapsed, loss, accuracy])
        if saved and rank == 0:  # state_dict() holds the synced model, the same on every rank: where each resumes
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            state.update(schedule=schedule.state_dict(), elapsed=elapsed, curve=curve)
            torch.save(state, saved + ".tmp")
            os.replace(saved + ".tmp", saved)

    def batch_size() -> int:
        """This worker's share of the step's examples: --batch-size, or --global-batch over the workers present."""
        return args.batch_size if args.global_batch is None else share_of(args.global_batch, members(model), rank)

    sizes = []  # (step, this worker's batch) at the first step and at each change
    sent_before = bytes_sent(model)
    if not curve:
        curve.append([first, 0.0, *task.evaluate(model.module, validation)])
    start_clock()
    for step in range(first + 1, args.steps + 1):
        if lost_here and step == args.lose_at and not first:
            os.kill(os.getpid(), signal.SIGKILL)  # a node lost: its worker gone without a word
        if args.join_at == step and rank == 0:  # the bench starts the node that joins
            open(args.join_marker, "w").close()
        size = batch_size()
        if not sizes or sizes[-1][1] != size:
            sizes.append([step, size])
        x, y = (t.to(device) for t in draw(size))
        loss = task.loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % args.eval_every == 0 or step == args.steps:
            stop_clock_and_validate(step)
            start_clock()
    train_loss = float(loss.detach())
    sent = sent_per_step(model, args.arm, sent_before, args.steps)

    if args.lose_node is not None or args.compare_replicas:  # every replica's end, to compare them
        final = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
        digest = hashlib.sha256(final.numpy().tobytes()).hexdigest()
        with open(f"{args.out}.rank{rank}", "w") as f:
            end = {"rank": rank, "rejoined_at": rejoined, "from_step": first, "parameters_sha256": digest}
            json.dump({**end, "batch_sizes": sizes}, f)
    if rank == min(members(model)):  # rank 0, or the lowest present once it was lost (store=etcd)
        result = {
            "arm": args.arm,
            "task": args.task,
            "world_size": dist.get_world_size(),
            "steps": args.steps,
            "seconds": elapsed,
            "curve": curve,
            "final_validation_loss": curve[-1][2],
            "final_validation_accuracy": curve[-1][3],
            "final_train_loss": train_loss,
            "bytes_per_step": sent,
            "comm_hook": comm_hook(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "auto_settings": said.lines,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    model = optimizer = schedule = None  # drops them (and the closures' references) before the group goes
    release_process_group()


if __name__ == "__main__":
    main()
