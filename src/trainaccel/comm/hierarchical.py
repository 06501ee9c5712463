"""Two-level allreduce: sum within the node, sum each node's shard across nodes, gather within the node.

The three stages run on three threads, bucket after bucket, so one bucket crosses the
network while the next is reduced inside the node. Each stage has a process group of its
own and issues its collectives in bucket order, the same order on every rank.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec, ErrorFeedback, NoCompression
from trainaccel.comm.exchange import all_gather_single, exchange, reduce_scatter_single
from trainaccel.comm.exit_guard import track
from trainaccel.comm.topology import Topology
from trainaccel.monitor import timeline

Stage = Callable[[Any], Any]


class StagedPipeline:
    """One thread per stage; a job's output from stage i is the input of stage i+1, jobs kept in order."""

    def __init__(self, stages: int, name: str = "trainaccel-comm"):
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(stages)]
        self._name = name
        self._threads: list[threading.Thread] = []

    def submit(self, stages: list[Stage], value: Any) -> torch.futures.Future:
        if len(stages) != len(self._queues):
            raise ValueError(f"a job needs {len(self._queues)} stages, got {len(stages)}")
        if not self._threads:
            for i in range(len(self._queues)):
                thread = threading.Thread(target=self._run, args=(i,), name=f"{self._name}-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        fut: torch.futures.Future = torch.futures.Future()
        self._queues[0].put((stages, value, None, fut))
        return fut

    def _run(self, index: int) -> None:
        last = index == len(self._queues) - 1
        while True:
            stages, value, error, fut = self._queues[index].get()
            if error is None:
                try:
                    value = stages[index](value)
                except BaseException as e:  # surfaces in DDP's backward on this rank
                    error = e
            if not last:
                # A failed job still passes through later stages (doing nothing) to keep the order.
                self._queues[index + 1].put((stages, value, error, fut))
            elif error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
            del stages, value, error, fut


class HierarchicalReduce:
    """Sums flat buffers over a multi-node job through the intra-node and inter-node groups."""

    def __init__(
        self,
        topology: Topology,
        codec: Codec,
        feedback: ErrorFeedback | None = None,
        intra_codec: Codec | None = None,
        intra_feedback: ErrorFeedback | None = None,
        chunk_mb: float = 4.0,
    ):
        if topology.why_flat() is not None:
            raise ValueError(f"no hierarchy to reduce over: {topology.why_flat()}")
        self.topology, self.codec, self.feedback = topology, codec, feedback
        self.intra_codec, self.intra_feedback = intra_codec or NoCompression(), intra_feedback
        # Buffers cross the pipeline in chunks, so that one chunk crosses nodes while the next
        # is summed in the node: with whole DDP buckets the link idles during the intra stages.
        self.chunk_mb = chunk_mb
        self.bytes_sent = 0  # across nodes
        self.intra_bytes_sent = 0
        self._pipeline = StagedPipeline(3)
        # Gloo's reduce-scatter is several times slower than its allreduce: on Gloo the first
        # stage allreduces the whole buffer inside the node and keeps this worker's shard.
        self._scatter_by_allreduce = dist.get_backend(topology.intra_group) == "gloo"

    def submit(self, buffer: torch.Tensor, key: Any) -> torch.futures.Future[torch.Tensor]:
        """Start summing `buffer` (in place); the future's value is `buffer` holding the sum."""
        chunk = max(1, int(self.chunk_mb * 2**20) // buffer.element_size())
        futures = [self._submit_chunk(part, (key, i)) for i, part in enumerate(buffer.split(chunk))]
        if len(futures) == 1:
            return futures[0]  # its value is the one chunk: all of `buffer`

        def whole(fut: torch.futures.Future) -> torch.Tensor:
            for part in fut.value():
                part.wait()  # raises the first chunk's error, if any
            return buffer

        return torch.futures.collect_all(futures).then(track(whole))

    def _submit_chunk(self, part: torch.Tensor, key: Any) -> torch.futures.Future[torch.Tensor]:
        stages = [
            timeline.traced("intra-node reduce", key, lambda b: self._sum_in_node(b, key)),
            lambda shard: self._sum_across_nodes(shard, key),  # traced by `exchange`
            timeline.traced("intra-node gather", key, lambda shard: self._gather_in_node(shard, part)),
        ]
        return self._pipeline.submit(stages, part)

    def _sum_in_node(self, buffer: torch.Tensor, key: Any) -> torch.Tensor:
        local_size, n = self.topology.local_size, buffer.numel()
        shard_size = -(-n // local_size)
        padded = torch.nn.functional.pad(buffer, (0, shard_size * local_size - n)) if n % local_size else buffer
        full = padded if self.intra_feedback is None else self.intra_feedback.correct(key, padded)
        payload, ctx = self.intra_codec.compress(full)
        if self.intra_feedback is not None:
            self.intra_feedback.update(key, full, self.intra_codec, payload, ctx)
        self.intra_bytes_sent += payload.numel() * payload.element_size()
        if self._scatter_by_allreduce:
            dist.all_reduce(payload, group=self.topology.intra_group)
            shard_payload = payload.narrow(0, self.topology.local_index * shard_size, shard_size)
        else:
            shard_payload = payload.new_empty(shard_size)
            reduce_scatter_single(shard_payload, payload, group=self.topology.intra_group)
        return self.intra_codec.decompress(shard_payload, ctx)

    def _sum_across_nodes(self, shard: torch.Tensor, key: Any) -> torch.Tensor:
        out = shard if self.feedback is not None else None  # folded into the residual: free to reuse
        fut, sent = exchange(self.codec, self.feedback, shard, key, self.topology.inter_group, out=out,
                             span_name="inter-node allreduce" if self.codec.summable else "inter-node allgather")
        self.bytes_sent += sent
        return fut.wait()

    def _gather_in_node(self, shard: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        payload, ctx = self.intra_codec.compress(shard)
        gathered = payload.new_empty(payload.numel() * self.topology.local_size)
        all_gather_single(gathered, payload.contiguous(), group=self.topology.gather_group)
        self.intra_bytes_sent += payload.numel() * payload.element_size()
        result = self.intra_codec.decompress(gathered, ctx)[: buffer.numel()]
        return buffer if result.data_ptr() == buffer.data_ptr() else buffer.copy_(result)

