"""What a sync costs in memory: at most its fragment's float32 size beside the model, and a chunk's for the outer step.

Counted on the CPU by a dispatch mode that follows every tensor torch allocates on the training thread (where a sync
is begun and applied) until its last Python reference goes: the peak over a sync step, against the fragment's
float32 bytes. The exchange itself runs on the communication thread; its payloads are the codec's (see
docs/communication.md). tests/gpu/test_cuda_sync_memory.py checks max_memory_allocated on a GPU.
"""

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainaccel.comm import DiLoCo, outer_sync
from trainaccel.config import Config


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated under it and still referenced: `peak` is their most at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage address -> [Python tensors on it, its bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            key = tensor.untyped_storage().data_ptr()
            if key in inputs and key not in self._refs:  # written in place into a tensor made elsewhere
                continue
            entry = self._refs.get(key)
            if entry is None:
                entry = self._refs[key] = [0, tensor.untyped_storage().nbytes()]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(tensor, self._release, key)
        return out

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self._refs[key]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 8 x 65,792 parameters


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    "options",
    [
        {"outer_optimizer": "nesterov"},
        {"outer_optimizer": "average"},
        {"outer_optimizer": "nesterov", "sync_overlap": 1},
        {"outer_optimizer": "nesterov", "sync_fragments": 2},
    ],
    ids=["nesterov", "average", "overlap", "fragments"],
)
def test_a_sync_holds_at_most_its_fragments_float32_size_beside_the_model(options, monkeypatch):
    monkeypatch.setattr(outer_sync, "STAGE_ELEMENTS", 2 * 65_792, raising=False)  # two layers' anchors staged at a time
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)  # in place: no temporaries of its own
    diloco = DiLoCo(model, inner, sync_every=2, config=Config(**options))
    params = sum(p.numel() for p in model.parameters())
    peaks = []
    for step in range(1, 9):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        with LiveBytes() as counted:
            inner.step()  # a sync begins (and, unless overlapped, is applied) inside
        inner.zero_grad()
        peaks.append(counted.peak)
    assert diloco.syncs >= 3
    fragment = max(sum(p.numel() for p in f) for f in diloco.fragments)
    largest = max(p.numel() for p in model.parameters())
    bound = 4 * (fragment + 2 * 65_792 + largest) + 2**16  # the change; the outer step's on a chunk; a tensor's
    # From the second sync on: the first inner step makes the anchors, the first sync the outer momentum (kept).
    assert max(peaks[3:]) <= bound, ([p / (4 * params) for p in peaks], bound / (4 * params))
    assert max(peaks[3:]) >= 4 * fragment  # counted: the change itself


@pytest.mark.parametrize("local_size", [2, 4, 8])
def test_a_syncs_pieces_across_nodes_are_sized_for_the_link_whatever_the_nodes_width(local_size):
    """Each worker sends SYNC_PIECE_MB per piece across nodes (its shard of a chunk): 4 MiB, not 4 MiB / the node's
    workers; the chunk in flight, and so a sync's temporaries in the node, grow with the node's width."""
    from trainaccel.comm.codecs import get_codec
    from trainaccel.comm.topology import Topology

    nodes = tuple(tuple(range(n * local_size, (n + 1) * local_size)) for n in range(2))
    hierarchy = outer_sync._sync_hierarchy(Topology(0, 2 * local_size, nodes, 0), get_codec("none"), None)
    assert hierarchy.chunk_mb / local_size == outer_sync.SYNC_PIECE_MB == 4.0
    assert hierarchy.check is True  # every sync's sums are read for finiteness


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("codec", ["int8", "fp4"])
def test_a_gathered_outer_codec_goes_in_pieces_and_syncs_as_in_one(codec, monkeypatch):
    """int8 and fp4 gather every replica's payload: a flat sync sends its change in pieces (GATHER_PIECE_ELEMENTS),
    so that it holds replicas x a piece's payload, not the fragment's; on block boundaries the result is the same
    bits as one exchange, and each piece keeps its own residual."""

    def run(piece: int) -> tuple[torch.Tensor, list]:
        monkeypatch.setattr(outer_sync, "GATHER_PIECE_ELEMENTS", piece)
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=0.01)
        diloco = DiLoCo(model, inner, sync_every=2, config=Config(outer_compression=codec))
        for step in range(1, 7):
            x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            inner.step()
            inner.zero_grad()
        residuals = sorted(map(str, diloco.outer.feedback.residuals))
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        diloco.detach()
        return params, residuals

    whole, whole_keys = run(2**30)
    pieces, piece_keys = run(256 * 1000)  # 256-element blocks: the pieces end on a block's boundary
    assert torch.equal(whole, pieces)
    assert whole_keys == ["diloco/0"] and len(piece_keys) == -(-8 * 65_792 // 256_000)  # 3 pieces
