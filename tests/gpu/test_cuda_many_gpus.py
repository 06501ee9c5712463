"""Several GPUs over NCCL, one worker per GPU: what a CPU cannot show (tools/gpu-check's multi-gpu stage).

The settings where two threads could share a communicator (an unused branch, SyncBatchNorm's collectives, two DDP
models, static_graph) under `sync_every` with a warm-up, with the owners check on: the synced model equal on every
rank, each node's replica equal where a node has several workers (4 GPUs). DDP over data-parallel subgroups with
the default group bound to its GPU (device_id), whose new communicators are split from the default one: they hang
unless every rank builds every group in one order (4 GPUs). Each test needs the GPUs it names and says so.
"""

import pytest
import torch

from conftest import SCRIPTS, read_ranks, run, run_nodes, trainaccel_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.many_gpus, pytest.mark.multiprocess]

SETTINGS = ["find_unused", "sync_bn_global", "sync_bn_node", "two_models", "static_graph"]
ON_GPUS = {"TEST_DEVICE": "cuda", "TRAINACCEL_CHECK_OWNERS": "1"}


def _gpus(needed: int) -> None:
    found = torch.cuda.device_count()
    if found < needed:
        pytest.skip(f"needs {needed} GPUs, found {found}: one worker per GPU over NCCL")


@pytest.mark.parametrize("scope, per_node", [("rank", 1), ("node", 2)])
def test_sync_every_with_a_warmup_under_every_ddp_setting_on_nccl(tmp_path, scope, per_node):
    _gpus(2 * per_node)
    settings = SETTINGS if scope == "node" else SETTINGS[:-1]  # rank scope refuses static_graph
    procs = run_nodes(
        SCRIPTS / "sync_hazards.py",
        tmp_path,
        ",".join(settings),
        per_node=per_node,
        launcher=[*trainaccel_cmd(), "run", "--sync-every", "4", "--sync-scope", scope, "--sync-warmup", "6"],
        env=ON_GPUS,
        timeout=300,
    )
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = read_ranks(tmp_path, 2 * per_node)
    for setting in settings:
        assert len({r[setting]["synced"] for r in ranks}) == 1, f"{setting}: the synced models differ"
        if per_node > 1:
            for node in ("0", "1"):
                assert len({r[setting]["replica"] for r in ranks if r["node"] == node}) == 1, (setting, node)


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "device_id"])
def test_ddp_over_subgroups_on_nccl(tmp_path, bound):
    _gpus(4)
    env = {**ON_GPUS, "BIND_DEVICE": "1" if bound else "0"}
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 4, SCRIPTS / "subgroup_ddp.py", tmp_path],
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = read_ranks(tmp_path, 4)
    assert all(r["built"] == [[[0, 2], False], [[1, 3], False]] for r in ranks)
    for r in ranks:
        assert r["digest"] == ranks[r["members"][0]]["digest"]
