"""on_lost_replica=continue with the model on the GPU: the lost-replica jobs of tests/resilience (3 emulated nodes,
`trainaccel run` per node, scripts/lost_replica.py) with every worker's model, data, anchors and outer state on GPU 0
and the membership's groups Gloo over CUDA tensors. A replica is killed, started again, takes the model, the outer
state and its optimizer's momentum from a live peer, and every replica ends equal."""

import pytest
import torch

from resilience import test_lost_replica as lost

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


@pytest.fixture
def on_device(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOST_REPLICA_DEVICE", device.type)  # read by the script each worker runs


def test_a_replica_killed_and_started_again_rejoins_on_the_gpu(tmp_path, on_device):
    """The explicit DiLoCo API, 3 nodes x 1 worker, SGD with momentum."""
    lost.test_a_replica_started_again_rejoins_and_every_replica_ends_equal(tmp_path, "rejoin")


def test_a_node_killed_and_started_again_rejoins_whole_on_the_gpu(tmp_path, on_device):
    """Zero-code (`trainaccel run --sync-every 4 --on-lost-replica continue` over a DDP script), 3 nodes x 2 workers,
    sync_scope=node."""
    lost.test_under_node_scope_a_node_started_again_rejoins_whole_and_every_replica_ends_equal(tmp_path, "node_rejoin")
