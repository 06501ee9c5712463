"""Frameworks x options x launch: each cell trains a client script and checks that the option is applied and training
is right (or that the option is refused with one line naming the client and the way out).

Clients are in tests/scripts/frameworks/ (one per framework; report.py writes each rank's JSON). The cells outside the
CI subset are marked frameworks_full: `pytest -m frameworks_full tests/frameworks` runs the whole matrix.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from conftest import SCRIPTS, read_ranks, run, run_nodes, torchrun_cmd, trainaccel_cmd

CLIENTS = {
    "plain": ("plain.py", None),
    "hf_trainer": ("hf_trainer.py", "transformers"),
    "lightning": ("lightning_mlp.py", "lightning"),
    "lightning_validate": ("lightning_validate.py", "lightning"),
    "accelerate": ("accelerate_loop.py", "accelerate"),
    # GPT-2 (tied head) under gradient accumulation, with save_state/load_state and safetensors round trips.
    "accelerate_gpt2": ("accelerate_gpt2.py", "accelerate"),
    "horovod": ("horovod_opt.py", None),
}
# Each option as trainaccel run flags; the one-line form passes the same options to trainaccel.init().
# topk's warm-up (20 exact steps by default) would cover most of a 12-step run: 2 leaves it 10 compressed steps.
OPTIONS = {
    "none": {},
    "fp16": {"compression": "fp16"},
    # fp16's scale from the peak (auto's on a GPU; dynamic is auto's on this CPU). fp16_scale first: a refusal names it.
    "fp16_peak": {"fp16_scale": "peak", "compression": "fp16"},
    "topk": {"compression": "topk", "compression_warmup": 2},
    "sync_every": {"sync_every": 4, "sync_scope": "rank"},
    # The outer codec whose CPU path runs in chunks (comm/codecs.py), under each client.
    "sync_every_fp4": {"sync_every": 4, "sync_scope": "rank", "outer_compression": "fp4"},
    "sync_every_node": {"sync_every": 4, "sync_scope": "node"},
    # The syncs over the members present (resilience/membership.py), applied under each client; nobody is lost here.
    "sync_every_continue": {"sync_every": 4, "sync_scope": "rank", "on_lost_replica": "continue"},
    # auto's measuring round (4 steps), then its own setting: H at most 4, fragments, overlap and the outer codec.
    "sync_every_auto": {"sync_every": "auto", "sync_scope": "rank"},
    # What the default sync_scope takes for a DDP model on nodes of several workers: a replica per node, auto's
    # measuring round and syncs through the node hierarchy.
    "sync_every_auto_node": {"sync_every": "auto", "sync_scope": "node"},
    "amp_bf16": {"amp": "bf16"},
    "shard_full": {"shard": "full"},
}
LAUNCHES = ("run", "init")
NODE_SCOPE = {option for option, given in OPTIONS.items() if given.get("sync_scope") == "node"}  # 2 nodes x 2
# The CI subset: every client once (Lightning with a validation loop under fp16: the hook on a model the framework
# leaves in eval mode), sync_every in three forms (fixed, fp4, auto), and the one-line form once; the other options
# run in CI outside a framework (`OUTSIDE`). The whole matrix is frameworks_full.
CI = {
    ("plain", "sync_every", "run"),
    ("plain", "fp16", "init"),
    ("hf_trainer", "sync_every_fp4", "run"),
    ("lightning", "sync_every_auto", "run"),
    ("lightning_validate", "fp16", "run"),
    ("accelerate", "none", "run"),
    ("accelerate_gpt2", "sync_every", "run"),
    ("horovod", "fp16", "run"),
}
# Options CI runs outside this matrix: node scope starts 4 workers (the engine's tests run it), tests/resilience runs
# the lost-replica mode's losses, the engine matrix runs fp16's peak scale and topk under every DDP setting, tests/amp
# amp's levels, tests/test_sharding.py the sharded modes.
OUTSIDE = {
    "sync_every_node",
    "sync_every_auto_node",
    "sync_every_continue",
    "fp16_peak",
    "topk",
    "amp_bf16",
    "shard_full",
}
# Cells that fail today, each with what was seen and where the cause is: strict, so that a fix shows as XPASS.
XFAIL: dict[tuple[str, str, str], str] = {}
# A refusal's line names the client (one of these words) and the option.
CLIENT_WORDS = {
    "plain": ("DistributedDataParallel", "DDP"),
    "hf_trainer": ("Trainer", "transformers"),
    "lightning": ("Lightning",),
    "lightning_validate": ("Lightning",),
    "accelerate": ("Accelerate", "accelerator"),
    "accelerate_gpt2": ("Accelerate", "accelerator", "accelerate."),
    "horovod": ("Horovod", "hvd", "DistributedOptimizer"),
}


def cells():
    for client in CLIENTS:
        for option in OPTIONS:
            for launch in LAUNCHES:
                marks = [pytest.mark.multiprocess]
                if (client, option, launch) not in CI:
                    marks.append(pytest.mark.frameworks_full)
                if (client, option, launch) in XFAIL:
                    marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[client, option, launch]))
                yield pytest.param(client, option, launch, marks=marks, id=f"{client}-{option}-{launch}")


def flags(options: dict) -> list[str]:
    return [word for k, v in options.items() for word in (f"--{k.replace('_', '-')}", str(v))]


def launch(client: str, option: str, how: str, out) -> tuple[int, str]:
    """Start the client on 2 workers (2 emulated nodes x 2 under sync_scope=node); its return code and output."""
    script, options = SCRIPTS / "frameworks" / CLIENTS[client][0], OPTIONS[option]
    one_line = ["--init", ",".join(f"{k}={v}" for k, v in options.items())] if how == "init" else []
    if option in NODE_SCOPE:
        launcher = [*trainaccel_cmd(), "run", *flags(options)] if how == "run" else torchrun_cmd()
        procs = run_nodes(script, out, *one_line, launcher=launcher, timeout=300)
        return max(p.returncode for p in procs), "".join(p.stdout for p in procs)
    if how == "run":
        cmd = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, *flags(options), script, out]
    else:
        cmd = [*torchrun_cmd(), "--standalone", "--nproc-per-node", 2, script, out, *one_line]
    proc = run(cmd, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def refusal(output: str, client: str, option: str) -> str | None:
    """The line refusing `option` for `client`, if the run ended on one."""
    name = next(iter(OPTIONS[option]), "")
    for line in output.splitlines():
        if name in line.replace("-", "_") and any(word in line for word in CLIENT_WORDS[client]):
            return line
    return None


def assert_trained_right(ranks: list[dict]) -> None:
    for r in ranks:
        losses = r["losses"]
        assert len(losses) == r["steps"] and all(math.isfinite(x) for x in losses), r["losses"]
        assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), f"rank {r['rank']}: the loss did not fall: {losses}"


def assert_replicas_equal(ranks: list[dict]) -> None:
    assert len({r["params_end"] for r in ranks}) == 1, "the ranks ended with different parameters"


def assert_observed_every_step(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["observer"], "trainaccel did not observe the client's DDP model"
        forwards = r["steps"] * r.get("accumulate", 1)  # a forward per micro-batch
        assert r["observer_steps"] == forwards, f"training forwards counted {r['observer_steps']}, expected {forwards}"


def assert_model_not_sent_again(ranks: list[dict]) -> None:
    """sync_every: the first step took the model DDP broadcast as it wrapped it (or hvd.broadcast_parameters did),
    sending it no more."""
    for r in ranks:
        assert r["largest_broadcast"] < r["elements"], (r["largest_broadcast"], r["elements"])


def assert_tied_weights_kept(ranks: list[dict]) -> None:
    """GPT-2's head and token embedding are one tensor in a look at the model, and the checkpoints round-trip."""
    for r in ranks:
        if "round_trips" in r:
            # A sharded model's full state dict is rank 0's alone.
            held = r["tied_state_dict"] if r["rank"] == 0 or not r["sharded_end"] else True
            assert held and r["tied_named_parameters"] and r["round_trips"], r


def assert_applied(option: str, ranks: list[dict]) -> None:
    dense = ranks[0]["dense_bytes_per_step"]
    if option == "none":
        assert_replicas_equal(ranks)
        if ranks[0]["ddp"]:
            assert_observed_every_step(ranks)
            assert all(r["comm_hook"] in (None, "BuiltinCommHookType.ALLREDUCE") for r in ranks)
    elif option in ("fp16", "fp16_peak", "topk"):
        if ranks[0]["ddp"] is None:  # Horovod's DistributedOptimizer: its compression is the codec
            assert all(option in (r.get("hvd_compression") or "").lower() for r in ranks), ranks[0].get(
                "hvd_compression"
            )
        else:
            assert all(r["comm_hook"] == "trainaccel_comm_hook" and r["comm"] == "CommState" for r in ranks)
            assert_observed_every_step(ranks)
            # topk: 1% of each bucket after 2 exact steps
            low, high = (0.0, 0.3) if option == "topk" else (0.4, 0.6)
            for r in ranks:
                assert low * dense < r["bytes_per_step"] < high * dense, (r["bytes_per_step"], dense)
        assert_replicas_equal(ranks)
    elif option.startswith("sync_every_auto"):  # its H, fragments and codec follow the times it measures
        for r in ranks:
            # The first round's sync at step 4 (in full precision, or after DDP's broadcast measured in the setting
            # chosen), then at least one more applied by step 12 (H at most 4; the last one may still be in flight
            # under its one step of overlap).
            assert r.get("diloco") and r["diloco"]["syncs"] >= 2, r.get("diloco")
            assert 0 < r["bytes_per_step"] < dense, (r["bytes_per_step"], dense)  # fewer than plain DDP's
            # H's cap follows the learning rate of the optimizer the client steps, read at each round's end.
            assert r["diloco"]["peak_lr"] > 0, r["diloco"]
        if ranks[0]["ddp"]:
            assert_observed_every_step(ranks)
            assert_model_not_sent_again(ranks)
        # Two replicas under the client's DDP: the link timed by DDP's broadcast as it wrapped the model, not by a
        # full-precision sync of auto's own (communication.md); four ranks in two-rank nodes: by that sync.
        by_broadcast = bool(ranks[0]["ddp"]) and len(ranks) == 2
        assert all(r["diloco"]["measured_by_broadcast"] == by_broadcast for r in ranks), [r["diloco"] for r in ranks]
        if option in NODE_SCOPE and ranks[0]["ddp"]:  # a replica per node: DDP keeps a node's workers equal
            live = [r["live_mid"] for r in ranks]
            assert live[0] == live[1] and live[2] == live[3], live
        assert len({r["synced_end"] for r in ranks}) == 1, "the synced model differs across ranks"
    elif option.startswith("sync_every"):
        for r in ranks:
            assert r.get("diloco") and r["diloco"]["syncs"] == r["steps"] // 4, r.get("diloco")
            assert r["bytes_per_step"] <= 0.3 * dense, (r["bytes_per_step"], dense)  # a sync every 4 steps
        if ranks[0]["ddp"]:
            assert_observed_every_step(ranks)
        assert_model_not_sent_again(ranks)  # Horovod: broadcast_parameters, then no second broadcast
        live = [r["live_mid"] for r in ranks]
        if option == "sync_every_node":  # a replica per node: equal within one, different across
            assert live[0] == live[1] and live[2] == live[3] and live[0] != live[2], live
        else:
            assert len(set(live)) == len(ranks), "between syncs the replicas should differ"
        assert len({r["synced_end"] for r in ranks}) == 1, "the synced model differs across ranks"
    elif option == "amp_bf16":
        assert all(r["out_dtype"] == "bfloat16" for r in ranks), [r["out_dtype"] for r in ranks]
        assert_replicas_equal(ranks)
    elif option == "shard_full":
        assert all(r["dtensor"] and r["sharded_end"] for r in ranks), "the parameters are not FSDP2 shards"
        assert_replicas_equal(ranks)  # the shards gathered whole: one model


@pytest.mark.parametrize("client, option, how", list(cells()))
def test_cell(client, option, how, tmp_path):
    package = CLIENTS[client][1]
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[frameworks]'")
    out = tmp_path / "out"
    code, output = launch(client, option, how, out)
    if code != 0:
        line = refusal(output, client, option)
        assert line is not None, output[-6000:]
        return
    world = 4 if option in NODE_SCOPE else 2
    ranks = read_ranks(out, world)
    if client == "accelerate_gpt2" and option.startswith("sync_every"):
        # load_state gave every rank the optimizer state rank 0 saved alone: said once, by rank 1.
        said = [line for line in output.splitlines() if "loaded an optimizer state saved by rank 0" in line]
        assert len(said) == 1 and "rank 1" in said[0], said
    assert_trained_right(ranks)
    assert_applied(option, ranks)
    assert_tied_weights_kept(ranks)


def test_the_ci_subset_covers_every_client_and_option():
    assert {client for client, _, _ in CI} == set(CLIENTS)
    assert {option for _, option, _ in CI} | OUTSIDE == set(OPTIONS)
