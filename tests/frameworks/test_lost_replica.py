"""on_lost_replica=continue under the framework clients: 3 emulated nodes x 1 worker (`trainaccel run --sync-every 4
--on-lost-replica continue` per node), rank 2 killed (SIGKILL) after step 5. A client's own collectives on the default
group are refused in training (one line): Lightning's per-batch SIGTERM broadcast catches the refusal, as it would any
failure, and an Accelerate loop makes none, so the other two train on and end with the same synced model; Hugging
Face's Trainer gathers token counts at every step, so it is refused at its second step, before any loss."""

from __future__ import annotations

import importlib.util
import re

import pytest

from conftest import SCRIPTS, read_ranks, run_nodes, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

CLIENTS = {  # script, package, whether its survivors train on
    "lightning": ("lightning_mlp.py", "lightning", True),
    "lightning_validate": ("lightning_validate.py", "lightning", True),
    "accelerate": ("accelerate_loop.py", "accelerate", True),
    "hf_trainer": ("hf_trainer.py", "transformers", False),
}
FULL = pytest.mark.frameworks_full  # outside CI's subset: the same path under another client


@pytest.mark.parametrize(
    "client",
    [
        "lightning",
        pytest.param("lightning_validate", marks=FULL),
        pytest.param("accelerate", marks=FULL),
        pytest.param("hf_trainer", marks=FULL),  # CI: its line is tests/resilience/test_rejoin.py's
    ],
)
def test_a_lost_replica_under_a_framework_client(client, tmp_path):
    script, package, trains_on = CLIENTS[client]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[frameworks]'")
    out = tmp_path / "out"
    launcher = [*trainaccel_cmd(), "run", "--sync-every", "4", "--on-lost-replica", "continue"]
    env = {"LOSE_AT": "5", "LOSE_RANK": "2"}
    procs = run_nodes(SCRIPTS / "frameworks" / script, out, nodes=3, per_node=1, launcher=launcher, env=env)
    outputs = [p.stdout for p in procs]
    said = outputs[0] + outputs[1]
    if trains_on:
        assert procs[2].returncode != 0 and "rank 2, pid" in outputs[2], outputs[2][-3000:]  # killed
        assert [p.returncode for p in procs[:2]] == [0, 0], said[-3000:]
        assert "goes on with 2 of 3 replicas, without rank 2" in said, said[-3000:]
        ranks = read_ranks(out, 2)
        assert [r["diloco"]["syncs"] for r in ranks] == [3, 3]  # at steps 4, 8 (without rank 2) and 12
        assert ranks[0]["synced_end"] == ranks[1]["synced_end"]
        if package == "lightning":  # Lightning's own sampler for the job (shuffled): halves after the loss
            size = 3 * 12 * 16  # every rank's 12 batches of 16 (report.dataset)
            parts = [r["sampler_after"] for r in ranks]
            assert [r["sampler"] for r in ranks] == ["DistributedSampler"] * 2
            assert [len(p) for p in parts] == [size // 2] * 2 and sorted(parts[0] + parts[1]) == list(range(size))
    else:  # every rank refused at the first gather in training, with one line
        assert all(p.returncode != 0 for p in procs), said[-3000:]
        line = re.compile(
            r"RuntimeError: all_gather\w*\(\) on the default group: called by accelerate\.\S+ in training"
        )
        for output in outputs:
            assert line.search(output) and "Hugging Face's Trainer" in output, output[-3000:]
