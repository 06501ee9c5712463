"""`trainaccel bench comm` worker: time allreduce through each codec over a sweep of message sizes."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from trainaccel.bench.worker import start_process_group
from trainaccel.comm.codecs import get_codec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--compression", required=True, help="comma-separated codecs")
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    device = start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name in args.compression.split(","):
        codec = get_codec(name)
        for size in map(int, args.sizes.split(",")):
            data = torch.randn(size // 4, device=device)
            times, payload_bytes = [], 0
            for i in range(args.warmup + args.iters):
                buffer = data.clone()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                started = time.perf_counter()
                payload, ctx = codec.compress(buffer.div_(world))
                dist.all_reduce(payload)
                codec.decompress(payload, ctx)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - started)
                payload_bytes = payload.numel() * payload.element_size()
            slowest = torch.tensor(statistics.median(times), device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds = float(slowest)
            algbw = size / seconds
            rows.append(
                {
                    "compression": name,
                    "size_bytes": size,
                    "payload_bytes": payload_bytes,
                    "time_s": seconds,
                    # nccl-tests' convention: bus bandwidth compares to the link's rate for any world size.
                    "algbw_gbit_s": algbw * 8 / 1e9,
                    "busbw_gbit_s": algbw * 2 * (world - 1) / world * 8 / 1e9,
                }
            )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
