"""How long each rank waits for a Gloo broadcast, and for an allreduce, of one model's worth of float32 on emulated
nodes (one worker each, a shaped link each): what a timed broadcast tells of the link, by the number of ranks.

    sudo python tools/broadcast_times.py --link 100mbit --nodes 2,3,4,5,8 [--elements 1841280] [--trials 2]

Each trial: an allgather lines the ranks up (as DDP's shape check does before its broadcast), then rank 0 broadcasts,
then a barrier and an allreduce of the same tensor; every rank's seconds are printed beside what the link's rate alone
would take for the bytes one rank receives (4 bytes per element).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

WORKER = "--worker"


def worker(elements: int, trials: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    tensor = torch.ones(elements)
    seconds = []  # by trial: every rank's (broadcast, allreduce)
    for _ in range(trials):
        dist.barrier()
        dist.all_gather_object([None] * size, rank)
        start = time.perf_counter()
        dist.broadcast(tensor, 0)
        broadcast = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        allreduce = time.perf_counter() - start
        times: list = [None] * size
        dist.all_gather_object(times, (broadcast, allreduce))
        seconds.append(times)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="100mbit", help="each node's link, as tc takes it (e.g. 100mbit)")
    parser.add_argument("--nodes", default="2,3,4", help="cluster sizes to run, comma-separated")
    parser.add_argument("--elements", type=int, default=1_841_280, help="float32 elements (the text task's model)")
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    from trainaccel.bench.emulate import EmulatedCluster, parse_emulate
    from trainaccel.bench.jobs import run_workers

    for nodes in (int(n) for n in args.nodes.split(",")):
        emulation = parse_emulate(f"nodes={nodes},procs-per-node=1,link={args.link}")
        alone = 4 * args.elements / (emulation.link_bits_per_s / 8)
        mib = 4 * args.elements / 2**20
        print(f"{nodes} nodes at {args.link}: {mib:.3g} MiB take {alone:.3f} s at the link's rate")
        with tempfile.TemporaryDirectory(prefix="broadcast-times-") as tmp, EmulatedCluster(emulation) as cluster:
            out = Path(tmp) / "seconds.json"
            launcher = [sys.executable, "-m", "torch.distributed.run"]
            worker_cmd = [__file__, WORKER, str(args.elements), str(args.trials), str(out)]
            seconds = run_workers(
                "broadcast_times", launcher, worker_cmd, out, dict(os.environ), nproc_per_node=1, cluster=cluster
            )
        for trial, times in enumerate(seconds):
            cells = " ".join(f"{b:.3f}/{a:.3f}" for b, a in times)
            print(f"ranks {nodes} trial {trial}: broadcast/allreduce seconds by rank: {cells}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
