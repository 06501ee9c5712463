"""The torchft arm of `trainaccel bench quality`: the quality worker's task, data and clock under torchft's DiLoCo.

Each replica group is a torchrun job of its own (one per emulated node, or one per worker), its workers a DDP model
when there are several; a torchft Manager per group meets the others' through the lighthouse and averages each
fragment's change over a `ProcessGroupGloo` every sync_every / F steps, as `torchft.local_sgd.DiLoCo` does. Ranks,
seeds, batches, model, optimizer, schedule and validations are the quality worker's: worker `rank` of the job is
`group x group size + local rank`, as it is there. The clock spans every group through a Gloo group of the
bench's own (over group 0's store), so that it starts and stops as the other arms' does.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import argparse
import contextlib
import datetime
import json
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchft.local_sgd import DiLoCo, LocalSGD
from torchft.manager import Manager
from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

from trainaccel.bench.tasks import add_task_arguments, get_task, warmup_cosine
from trainaccel.bench.worker import release_process_group, start_process_group
from trainaccel.comm.outer_sync import split_fragments

TIMEOUT = datetime.timedelta(seconds=120)  # a sync's quorum waits for the slowest group's H steps


def outer_optimizer(params: list[torch.Tensor], name: str, lr: float, momentum: float) -> torch.optim.Optimizer:
    """trainaccel's outer step as torch's SGD: `average` is lr 1 without momentum (the anchor minus the mean change)."""
    if name == "average":
        return torch.optim.SGD(params, lr=1.0, momentum=0.0)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nesterov" and momentum > 0)


@contextlib.contextmanager
def synced(diloco: DiLoCo) -> Iterator[None]:
    """The synced model (each fragment's parameters as of its last sync) in place of the live one for a look."""
    live = []
    with torch.no_grad():
        for fragment in diloco._fragments:  # torchft 0.2 keeps each fragment's last synced values here
            for name, p in fragment._model_fragment.named_parameters():
                live.append((p, p.detach().clone()))
                p.copy_(fragment.original_parameters[name].to(p.device))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, kept in live:
                p.copy_(kept)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_task_arguments(parser)
    parser.add_argument("--group", type=int, required=True, help="this replica group's index")
    parser.add_argument("--groups", type=int, required=True, help="replica groups in the job")
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://HOST:PORT")
    parser.add_argument("--host", required=True, help="the address this group's manager is reached at")
    parser.add_argument("--clock", required=True, help="HOST:PORT of group 0's store, for the bench's clock")
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--sync-fragments", type=int, default=1)
    parser.add_argument("--sync-overlap", type=int, default=0, help="torchft's fragment_sync_delay")
    parser.add_argument("--fragment-update-alpha", type=float, default=0.0)
    parser.add_argument("--outer-optimizer", default="average")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    args = parser.parse_args()

    device = start_process_group()  # this replica group's own workers (its torchrun's)
    local_rank, group_size = dist.get_rank(), dist.get_world_size()
    rank, world = args.group * group_size + local_rank, args.groups * group_size
    host, port = args.clock.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    clock = dist.ProcessGroupGloo(dist.PrefixStore("trainaccel-clock", store), rank, world, TIMEOUT)

    task = get_task(args.task)
    train, validation = task.load()
    validation = type(validation)(validation.inputs.to(device), validation.targets.to(device))
    torch.manual_seed(args.seed)  # the same initial model on every rank and in every arm
    module = task.build().to(device)
    ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(module, device_ids=ids) if group_size > 1 else module  # a node's workers
    optimizer = task.optimizer(list(model.parameters()))
    schedule = warmup_cosine(optimizer, args.steps)
    draw = task.batches(train, args.batch_size, seed=args.seed * 1000 + rank)

    manager = Manager(
        pg=ProcessGroupBabyNCCL(timeout=TIMEOUT) if device.type == "cuda" else ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=args.groups,  # every group in every sync, as trainaccel's syncs under on_lost_replica=stop
        use_async_quorum=False,  # DiLoCo's requirement
        init_sync=False,  # every group starts from the same seeded model
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        rank=local_rank,
        world_size=group_size,
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
        hostname=args.host,  # (the machine's name does not resolve inside an emulated node)
    )
    sent = 0
    allreduce = manager.allreduce

    def counted(tensor: torch.Tensor, *rest: object, **options: object) -> object:
        nonlocal sent  # the bytes this worker puts into the syncs' allreduces, as trainaccel counts its own
        sent += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *rest, **options)

    manager.allreduce = counted
    params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
    runs = split_fragments(params, args.sync_fragments)  # trainaccel's fragments, tensor for tensor
    fragments = [torch.nn.ParameterList(run) for run in runs]
    outers = [outer_optimizer(run, args.outer_optimizer, args.outer_lr, args.outer_momentum) for run in runs]
    pinned = device.type == "cuda"  # the backups in host memory, pinned for a GPU's copies as torchft's default
    diloco = DiLoCo(
        manager,
        fragments,
        optimizer,
        outers,
        sync_every=args.sync_every,
        pin_memory=pinned,
        fragment_sync_delay=args.sync_overlap,
        fragment_update_alpha=args.fragment_update_alpha,
    )

    curve = []  # (step, seconds of training so far, validation loss, validation accuracy)
    elapsed, started = 0.0, 0.0
    max_op = dist.AllreduceOptions()
    max_op.reduceOp = dist.ReduceOp.MAX

    def start_clock() -> None:
        nonlocal started
        clock.allreduce([torch.zeros(1)]).wait()  # every worker of every group starts together
        started = time.perf_counter()

    def stop_clock_and_validate(step: int) -> None:
        nonlocal elapsed
        # The final model is the replicas' average, on the clock, as trainaccel's sync_replicas makes it: needed
        # where some fragment trained since its last sync.
        final_average = step == args.steps and (len(fragments) > 1 or step % args.sync_every)
        if final_average:
            LocalSGD(manager, module, optimizer, sync_every=1).sync()
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - started])
        clock.allreduce([took], max_op).wait()  # the slowest worker sets the pace
        elapsed += float(took)
        with contextlib.nullcontext() if final_average else synced(diloco):
            loss, accuracy = task.evaluate(module, validation)
        curve.append([step, elapsed, loss, accuracy])

    curve.append([0, 0.0, *task.evaluate(module, validation)])
    with diloco:
        start_clock()
        for step in range(1, args.steps + 1):
            x, y = (t.to(device) for t in draw())
            loss = task.loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()  # DiLoCo's hook: a fragment's sync when one is due
            schedule.step()
            if step % args.eval_every == 0 or step == args.steps:
                stop_clock_and_validate(step)
                start_clock()

    if rank == 0:
        result = {
            "arm": "torchft",
            "task": args.task,
            "world_size": world,
            "steps": args.steps,
            "seconds": elapsed,
            "curve": curve,
            "final_validation_loss": curve[-1][2],
            "final_validation_accuracy": curve[-1][3],
            "final_train_loss": float(loss.detach()),
            "bytes_per_step": sent / args.steps,
            "comm_hook": None,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    manager.shutdown(wait=False)
    model = optimizer = schedule = diloco = None  # drops them before the group goes
    release_process_group()


if __name__ == "__main__":
    main()
