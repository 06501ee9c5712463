"""Two-level allreduce: sum within the node, sum each node's shard across nodes, gather within the node.

A bucket goes through in chunks, pipelined on the engine's one communication thread: chunk i
is summed in the node while chunk i-1 crosses nodes and chunk i-2 is gathered. The order in
which the collectives are issued depends only on the number of chunks, so it is the same on
every rank; each stage has a process group of its own.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec, ErrorFeedback, NoCompression
from trainaccel.comm.exchange import (
    EXACT,
    NOT_FINITE,
    all_finite,
    all_gather_single,
    encode,
    needs_check,
    note_overflow,
    reduce_scatter_single,
    start_exchange,
)
from trainaccel.comm.topology import Topology, hold
from trainaccel.devices import backend_of
from trainaccel.monitor import timeline


class _Step:
    """One chunk's collective in flight in one stage: `finish()` waits, returns (output, (level, fallback) or None)."""

    def __init__(self, name: str, key: Any, work: Any, finish: Any):
        self.name, self.key, self.work, self._finish = name, key, work, finish
        self.began = time.perf_counter()

    def finish(self) -> Any:
        if self.work is not None:
            self.work.wait()
        out = self._finish()
        trace = timeline.current()
        if trace is not None and self.name:
            trace.span(self.name, self.began, time.perf_counter(), timeline.bucket_track(self.key))
        return out


class HierarchicalReduce:
    """Sums flat buffers over a multi-node job through the intra-node and inter-node groups."""

    @property
    def groups(self) -> tuple:
        """The process groups it issues on (in the node: sum and gather; across nodes)."""
        t = self.topology
        return (t.intra_group, t.gather_group, t.inter_group)

    def __init__(
        self,
        topology: Topology,
        codec: Codec,
        feedback: ErrorFeedback | None = None,
        intra_codec: Codec | None = None,
        intra_feedback: ErrorFeedback | None = None,
        chunk_mb: float = 4.0,
        check: bool | None = None,
    ):
        if topology.why_flat() is not None:
            raise ValueError(f"no hierarchy to reduce over: {topology.why_flat()}")
        self.topology, self.codec, self.feedback = topology, codec, feedback
        hold(topology)  # its groups stay while a reduction over them may run
        self.intra_codec, self.intra_feedback = intra_codec or NoCompression(), intra_feedback
        # Buffers cross the pipeline in chunks, so that one chunk crosses nodes while the next
        # is summed in the node: with whole DDP buckets the link idles during the intra stages.
        self.chunk_mb = chunk_mb
        # Whether sums are read on the host for the exact retry: always (True), or where the codec needs it (None).
        self.check = check
        self.bytes_sent = 0  # received across nodes
        self.intra_bytes_sent = 0
        self._velocity: tuple[tuple[torch.Tensor, ...], int] | None = None  # the reduction in progress's (chunks)
        self._scatter_by_allreduce = False  # the reduction in progress's first stage: see `reduce`

    def reduce(
        self, buffer: torch.Tensor, key: Any, velocity: torch.Tensor | None = None, *, replicated: bool = False
    ) -> tuple[torch.Tensor, list[tuple[str, str]]]:
        """Sum `buffer` in place (call on the communication thread); returns it and the (level, fallback) taken.

        `velocity` (laid out as `buffer`, this worker's share) starts the momentum of error feedback across nodes.
        `replicated`: `buffer` is the same on every worker of a node, and the sum is over nodes only (each worker
        sends its shard of it across nodes, then the node gathers).
        """
        chunk = max(1, int(self.chunk_mb * 2**20) // buffer.element_size())
        self._velocity = None if velocity is None else (velocity.split(chunk), chunk)
        # Gloo's reduce-scatter is several times slower than its allreduce: on Gloo (the backend of the buffer's
        # device: "cpu:gloo,cuda:nccl" reduces CPU tensors with Gloo) the first stage allreduces the whole buffer
        # inside the node and keeps this worker's shard. A codec in the node whose sum is read for finiteness does so
        # too: every worker of the node must see the whole sum to decide alike whether it is finite.
        self._scatter_by_allreduce = (
            needs_check(self.intra_codec, self.check) or backend_of(self.topology.intra_group, buffer.device) == "gloo"
        )
        fallbacks: list[tuple[str, str]] = []
        stages: list[collections.deque] = [collections.deque(), collections.deque(), collections.deque()]
        first = self._take_shard if replicated else self._start_sum_in_node
        starts = [first, self._start_sum_across_nodes, self._start_gather_in_node]

        def advance(depth: int) -> None:
            # Finish the oldest step of each stage while more than `depth` are in flight, and start its next stage.
            for s in range(3):
                while len(stages[s]) > depth:
                    part, key_i, step = stages[s].popleft()
                    value, fallback = step.finish()
                    if fallback is not None:
                        fallbacks.append(fallback)
                    if s < 2:
                        stages[s + 1].append((part, key_i, starts[s + 1](value, key_i, part)))

        for i, part in enumerate(buffer.split(chunk)):
            stages[0].append((part, (key, i), first(part, (key, i), part)))
            advance(1)
        advance(0)
        return buffer, fallbacks

    def _padded(self, part: torch.Tensor) -> tuple[torch.Tensor, int]:
        """`part` padded with zeros to a multiple of the node's workers, and the size of each one's shard."""
        local_size, n = self.topology.local_size, part.numel()
        shard_size = -(-n // local_size)
        return (torch.nn.functional.pad(part, (0, shard_size * local_size - n)) if n % local_size else part), shard_size

    def _start_sum_in_node(self, part: torch.Tensor, key: Any, _: torch.Tensor) -> _Step:
        padded, shard_size = self._padded(part)
        full = padded if self.intra_feedback is None else self.intra_feedback.correct(key, padded)
        payload, ctx = encode(self.intra_codec, full, key, self.topology.intra_group)
        if self.intra_feedback is not None:
            self.intra_feedback.update(key, full, self.intra_codec, payload, ctx)
        self.intra_bytes_sent += payload.numel() * payload.element_size()
        group, offset = self.topology.intra_group, self.topology.local_index * shard_size
        if self._scatter_by_allreduce:
            work = dist.all_reduce(payload, group=group, async_op=True)
            shard_payload = payload.narrow(0, offset, shard_size)
        else:
            shard_payload = payload.new_empty(shard_size)
            work = reduce_scatter_single(shard_payload, payload, group=group, async_op=True)

        def finish() -> tuple[torch.Tensor, tuple[str, str] | None]:
            if needs_check(self.intra_codec, self.check) and not bool(all_finite(payload)):
                # The whole node sees this sum: every worker of it retries exactly, alike.
                note_overflow(self.intra_codec, key)
                if self.intra_feedback is not None:
                    self.intra_feedback.clear(key)
                dist.all_reduce(padded, group=group)
                return padded.narrow(0, offset, shard_size), ("in the node", _which(padded))
            return self.intra_codec.decompress(shard_payload, ctx), None

        return _Step("intra-node reduce", key, work, finish)

    def _take_shard(self, part: torch.Tensor, key: Any, _: torch.Tensor) -> _Step:
        """The first stage when the node's workers hold the same values: this worker's shard, nothing sent."""
        padded, shard_size = self._padded(part)
        shard = padded.narrow(0, self.topology.local_index * shard_size, shard_size)
        return _Step("", key, None, lambda: (shard, None))

    def _start_sum_across_nodes(self, shard: torch.Tensor, key: Any, _: torch.Tensor) -> _Step:
        out = shard if self.feedback is not None else None  # folded into the residual: free to reuse
        pending = start_exchange(
            self.codec,
            self.feedback,
            shard,
            key,
            self.topology.inter_group,
            out=out,
            span_name="inter-node allreduce" if self.codec.summable else "inter-node allgather",
            velocity=self._shard_velocity(key[1], shard.numel()),
            check=self.check,
        )

        def finish() -> tuple[torch.Tensor, tuple[str, str] | None]:
            outcome = pending.finish()
            self.bytes_sent += outcome.sent
            return outcome.result, None if outcome.fallback is None else ("across nodes", outcome.fallback)

        return _Step("", key, None, finish)  # `exchange` records its own encode, collective and decode spans

    def _shard_velocity(self, i: int, shard_size: int) -> torch.Tensor | None:
        """This node's share of chunk `i`'s velocity, at this worker's shard: the node's workers' shares summed."""
        if self._velocity is None:
            return None
        parts, _ = self._velocity
        part = parts[i]
        padded = torch.nn.functional.pad(part, (0, shard_size * self.topology.local_size - part.numel()))
        return padded.narrow(0, self.topology.local_index * shard_size, shard_size) * self.topology.local_size

    def _start_gather_in_node(self, shard: torch.Tensor, key: Any, part: torch.Tensor) -> _Step:
        local_size, group = self.topology.local_size, self.topology.gather_group
        payload, ctx = encode(self.intra_codec, shard, key, group)  # decoded with one ctx: the same scale everywhere
        gathered = payload.new_empty(payload.numel() * local_size)
        work = all_gather_single(gathered, payload.contiguous(), group=group, async_op=True)
        self.intra_bytes_sent += payload.numel() * payload.element_size()

        def finish() -> tuple[torch.Tensor, tuple[str, str] | None]:
            fallback = None
            if needs_check(self.intra_codec, self.check) and not bool(all_finite(gathered)):
                note_overflow(self.intra_codec, key)
                exact = shard.new_empty(shard.numel() * local_size)
                all_gather_single(exact, shard.contiguous(), group=group)
                result, fallback = exact, ("in the node's gather", _which(exact))
            else:
                result = self.intra_codec.decompress(gathered, ctx)
            result = result[: part.numel()]
            return (part if result.data_ptr() == part.data_ptr() else part.copy_(result)), fallback

        return _Step("intra-node gather", key, work, finish)


def _which(exact: torch.Tensor) -> str:
    return EXACT if bool(exact.isfinite().all()) else NOT_FINITE
