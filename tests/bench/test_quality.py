"""`trainaccel bench quality`: its real tasks, its time-to-target arithmetic, and a tiny run of every arm."""

import json
import re
import sys

import pytest
import torch

from conftest import run, trainaccel_cmd
from trainaccel.bench.quality import render, summarize, time_to
from trainaccel.bench.tasks import TASKS, get_task, load_text
from trainaccel.bench.train import parse_arms
from trainaccel.bench.worker import ARMS, set_up_arm


def test_text_task_is_the_python_reference_with_the_last_tenth_held_out():
    from pydoc_data.topics import topics

    train, validation = load_text(context=16)
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    cut = int(len(text) * 0.9)
    x, y = train.take(torch.tensor([0, 1000, len(train) - 1]))
    assert bytes(x[1].tolist()) == text[1000:1016] and bytes(y[1].tolist()) == text[1001:1017]
    assert int(train.starts[-1]) + 17 <= cut  # no training window reaches the held-out text
    assert len(validation) == 256 and validation.inputs.shape == (256, 16)
    held = text[cut:]
    first = bytes(validation.inputs[0].tolist())
    assert held.startswith(first) and bytes(validation.targets[0].tolist()) == held[1:17]


def test_digits_task_splits_all_1797_images_once_into_train_and_validation():
    train, validation = get_task("digits").load()
    assert (len(train), len(validation)) == (1437, 360)
    assert train.inputs.shape[1:] == (1, 8, 8) and 0 <= float(train.inputs.min()) <= float(train.inputs.max()) <= 1
    images = torch.cat([train.inputs, validation.inputs]).flatten(1)
    assert torch.unique(images, dim=0).shape[0] >= 1790  # a few digits repeat in the data itself, not in our split
    assert sorted(torch.cat([train.targets, validation.targets]).bincount().tolist())[0] >= 170  # ten classes


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_learns_in_a_few_steps_and_evaluates_deterministically(name):
    task = TASKS[name]
    train, validation = task.load()
    torch.manual_seed(0)
    model = task.build()
    before = task.evaluate(model, validation)
    assert task.evaluate(model, validation) == before
    optimizer = task.optimizer(list(model.parameters()))
    draw = task.batches(train, 16, seed=1)
    for _ in range(8):
        x, y = draw()
        loss = task.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = task.evaluate(model, validation)
    assert after[0] < before[0] and 0 <= after[1] <= 1


def test_the_optimizers_are_the_ones_users_pick():
    model = torch.nn.Linear(2, 2)
    assert isinstance(TASKS["text"].optimizer(list(model.parameters())), torch.optim.AdamW)
    sgd = TASKS["digits"].optimizer(list(model.parameters()))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


def test_time_to_target_is_the_first_validation_at_or_below_it():
    curve = [[0, 0.0, 3.0, 0.1], [10, 5.0, 2.0, 0.3], [20, 9.0, 1.5, 0.5], [30, 14.0, 1.6, 0.5]]
    assert time_to(curve, 2.0) == 5.0 and time_to(curve, 1.55) == 9.0 and time_to(curve, 1.0) is None
    assert time_to(curve, 3.0) == 5.0  # the untrained model does not count, even if it is good enough


def test_summaries_pair_repeats_and_judge_quality_against_plain_ddp():
    def result(seconds, losses):
        curve = [[i * 10, seconds * i / (len(losses) - 1), loss, 0.5] for i, loss in enumerate(losses)]
        return {
            "seconds": seconds,
            "curve": curve,
            "final_validation_loss": losses[-1],
            "final_validation_accuracy": 0.5,
            "bytes_per_step": 4.0,
            "comm_hook": None,
            "parameters": 3,
        }

    runs = {
        "baseline": [result(10.0, [3.0, 2.0, 1.0]), result(20.0, [3.0, 2.0, 1.0])],
        "good": [result(5.0, [3.0, 1.01, 1.01]), result(5.0, [3.0, 2.0, 1.0])],
        "bad": [result(2.0, [3.0, 2.0, 1.5]), result(2.0, [3.0, 2.0, 1.5])],
        # Another seed's baseline may end above this one's target: each repeat is judged against its own.
        "seeded": [result(5.0, [3.0, 1.0, 1.0]), result(5.0, [3.0, 1.5, 1.0])],
        "local": [result(4.0, [3.0, 2.5, 2.0]), result(4.0, [3.0, 2.5, 2.0])],
    }
    s = summarize(runs)
    assert s["baseline"]["target_loss"] == pytest.approx([1.02, 1.02])
    assert s["baseline"]["speedup"] == 1.0 and s["baseline"]["keeps_quality"]
    assert s["good"]["speedup"] == pytest.approx(3.0)  # median of 10/5 and 20/5
    assert s["good"]["seconds_to_target"] == [2.5, 5.0] and s["good"]["speedup_to_target"] == pytest.approx(4.0)
    assert s["good"]["keeps_quality"] and s["good"]["loss_vs_baseline"] == pytest.approx(0.005)
    assert not s["bad"]["keeps_quality"] and s["bad"]["loss_vs_baseline"] == pytest.approx(0.5)
    assert s["bad"]["seconds_to_target"] == [None, None] and "speedup_to_target" not in s["bad"]
    assert s["seeded"]["seconds_to_target"] == [2.5, 5.0] and s["seeded"]["loss_vs_baseline"] == 0.0
    assert s["good"]["share_of_ceiling"] == pytest.approx(0.8) and s["baseline"]["share_of_ceiling"] == pytest.approx(
        0.3
    )
    # Where each node trained alone (node-local), that is the ceiling: the in-node exchange is not the link's cost.
    s = summarize({**runs, "node-local": [result(4.5, [3.0, 2.5, 2.0])] * 2})
    assert s["good"]["share_of_ceiling"] == pytest.approx(0.9) and s["node-local"]["keeps_quality"]


def test_a_table_without_plain_ddp_shows_no_target_instead_of_failing(capsys):
    run = {"seconds": 2.0, "curve": [[0, 0.0, 3.0, 0.1], [10, 2.0, 2.0, 0.3]], "final_validation_loss": 2.0}
    run.update(final_validation_accuracy=0.3, bytes_per_step=0.0, comm_hook=None, parameters=3)
    summary = summarize({"local": [run], "variant": [dict(run, seconds=4.0)]})
    render(summary, "no baseline", "accuracy", {})
    out = capsys.readouterr().out
    assert "variant" in out and "50%" in out and "not reached" not in out


@pytest.mark.parametrize("arm", ARMS)
def test_only_the_local_arm_exchanges_nothing_not_even_buffers(arm, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if arm == "torch-bf16":
        pytest.skip("torch's bf16 hook needs CUDA and NCCL")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        module = torch.nn.BatchNorm1d(3)  # buffers that DDP broadcasts at every forward unless told not to
        model = DistributedDataParallel(module)
        set_up_arm(model, arm)
        # A broadcast per step is a barrier across the slow link: the ceiling would pay for communication.
        assert model.broadcast_buffers is (arm not in ("local", "node-local"))
    finally:
        model = None
        dist.destroy_process_group()


def test_bad_arms_are_refused_naming_what_is_accepted():
    with pytest.raises(ValueError, match="invalid --arms 'baseline,nope'; accepted: .*torch-fp16"):
        parse_arms("baseline,nope", ARMS)
    with pytest.raises(ValueError, match="invalid --arms 'local,local'"):
        parse_arms("local,local", ARMS)
    assert "node-local" not in parse_arms(None, ARMS)  # where asked: on nodes of one worker it is local
    if not torch.cuda.is_available():
        assert "torch-bf16" not in parse_arms(None, ARMS)
        with pytest.raises(ValueError, match="torch-bf16 needs CUDA and NCCL"):
            parse_arms("baseline,torch-bf16", ARMS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "invalid --steps 0; accepted: an integer >= 1"),
        (["--task", "imagenet"], "invalid choice: 'imagenet'"),
        (["--variant", "baseline:compression=fp16"], "with a label other than baseline"),
    ],
)
def test_bad_flags_stop_before_any_worker_starts(cli, monkeypatch, flags, message):
    from trainaccel.bench import jobs

    monkeypatch.setattr(jobs, "run_workers", lambda *a, **k: pytest.fail("a worker started"))
    proc = cli(["bench", "quality", *flags])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "lose, message",
    [
        ("lost:2@100", None),
        ("lost:0@100", "NODE in 1..2 (node 0 holds the store: lose it under --emulate ...,store=etcd)"),
        ("lost:3@100", "NODE in 1..2"),
        ("lost:2@301", "STEP in 1..300"),
        ("other:2@100", "ARM one of lost, same"),
        ("lost:2", "accepted: ARM:NODE@STEP"),
        ("same:2@100", "arm same does not go on without a lost replica"),
        ("same:2@100 restart", None),
    ],
)
def test_lose_names_an_arm_that_goes_on_a_node_other_than_the_first_and_a_step(lose, message):
    from argparse import Namespace

    from trainaccel.bench.quality import parse_losses

    arms = {"lost": {"sync_every": "4", "on_lost_replica": "continue"}, "same": {"sync_every": "4"}}
    lose, _, restart = lose.partition(" ")
    args = Namespace(lose=[lose], steps=300, rejoin=[], restart=["same"] if restart else [], keep_global_batch=[])
    if message is None:
        assert parse_losses(args, arms, nodes=3) == {lose.partition(":")[0]: (2, 100)}
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_losses(args, arms, nodes=3)


def test_node_0_may_be_lost_with_the_store_on_etcd():
    from argparse import Namespace

    from trainaccel.bench.quality import parse_losses

    arms = {"lost": {"sync_every": "4", "on_lost_replica": "continue"}}
    args = Namespace(lose=["lost:0@100"], steps=300, rejoin=[], restart=[], keep_global_batch=[])
    assert parse_losses(args, arms, nodes=3, store="etcd") == {"lost": (0, 100)}
    with pytest.raises(ValueError, match=re.escape("NODE in 0..2 and STEP")):
        parse_losses(Namespace(**{**vars(args), "lose": ["lost:3@100"]}), arms, nodes=3, store="etcd")


def test_rejoin_names_an_arm_that_loses_a_node():
    from argparse import Namespace

    from trainaccel.bench.quality import parse_losses

    arms = {"lost": {"sync_every": "4", "on_lost_replica": "continue"}, "other": {"sync_every": "4"}}
    flags = {"lose": ["lost:2@9"], "steps": 300, "restart": [], "keep_global_batch": []}
    assert parse_losses(Namespace(**flags, rejoin=["lost"]), arms, nodes=3) == {"lost": (2, 9)}
    with pytest.raises(
        ValueError, match=re.escape("invalid --rejoin 'other'; accepted: an arm given to --lose (lost)")
    ):
        parse_losses(Namespace(**flags, rejoin=["other"]), arms, nodes=3)


@pytest.mark.parametrize(
    ("join", "store", "message"),
    [
        ("grow@100", "etcd", None),
        ("grow@never", "etcd", None),
        ("grow@100", "agent", "a job grows with its store on etcd"),
        ("plain@100", "etcd", "arm plain has no sync_every with on_lost_replica=continue"),
        ("baseline@100", "etcd", "accepted: ARM@STEP with ARM a trainaccel arm"),
        ("grow@300", "etcd", "STEP in 1 to --steps - 1, or never"),
        ("grow@soon", "etcd", "STEP in 1 to --steps - 1, or never"),
        ("lost@100", "etcd", "arm lost also loses a node; one scenario per arm"),
    ],
)
def test_join_names_a_trainaccel_arm_that_survives_losses_a_step_and_a_store_on_etcd(join, store, message):
    from argparse import Namespace

    from trainaccel.bench.emulate import Emulation
    from trainaccel.bench.quality import parse_joins

    survives = {"sync_every": "4", "on_lost_replica": "continue"}
    arms = {"baseline": {}, "grow": survives, "plain": {"sync_every": "4"}, "lost": survives}
    args = Namespace(join=[join], lose=["lost:2@9"], rejoin=[], steps=300)
    emulation = Emulation(4, 1, "500mbit", None, store)
    if message is None:
        assert parse_joins(args, arms, emulation) == {"grow": 0 if join.endswith("never") else 100}
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_joins(args, arms, emulation)


@pytest.mark.multiprocess
def test_a_command_started_later_starts_when_due_and_one_never_due_is_not_waited_for(tmp_path):
    from trainaccel.launch.local import run_together

    marker = tmp_path / "go"
    first = ["sh", "-c", f"sleep 0.3; touch {marker}; sleep 0.5"]
    later = ["sh", "-c", f"test -e {marker} && touch {tmp_path / 'joined'}"]
    assert run_together([first, later], later={1: marker.exists}) == (0, None)
    assert (tmp_path / "joined").exists()
    assert run_together([["true"], ["false"]], later={1: lambda: False}) == (0, None)


def test_keep_global_batch_names_an_arm_of_the_run():
    from argparse import Namespace

    from trainaccel.bench.quality import parse_losses

    arms = {"lost": {"sync_every": "4", "on_lost_replica": "continue"}, "auto": {"sync_every": "auto"}}
    flags = {"lose": ["lost:2@9"], "steps": 300, "restart": [], "rejoin": []}
    assert parse_losses(Namespace(**flags, keep_global_batch=["lost", "auto"]), arms, nodes=3) == {"lost": (2, 9)}
    with pytest.raises(
        ValueError, match=re.escape("invalid --keep-global-batch 'lots'; accepted: one of the arms, lost, auto")
    ):
        parse_losses(Namespace(**flags, keep_global_batch=["lots"]), arms, nodes=3)


def test_a_workers_batch_is_its_share_of_the_global_batch_over_the_workers_present():
    from trainaccel.bench.quality_worker import share_of

    assert [share_of(12, [0, 1, 2], r) for r in (0, 1, 2)] == [4, 4, 4]
    assert [share_of(12, [0, 1], r) for r in (0, 1)] == [6, 6]
    assert [share_of(13, [0, 2, 5], r) for r in (0, 2, 5)] == [5, 4, 4]  # every example drawn, one more on the first
    assert share_of(12, [3], 3) == 12


@pytest.mark.multiprocess
def test_run_together_starts_a_lost_node_again_once_and_needs_it_to_succeed(tmp_path):
    from trainaccel.launch.local import run_together

    ok = [sys.executable, "-c", "import time; time.sleep(1)"]
    # Fails at its first start, succeeds at its second (the marker file tells them apart).
    once = [sys.executable, "-c", "import os, sys; p = sys.argv[1]; os.path.exists(p) or open(p, 'w') and exit(9)"]
    assert run_together([ok, [*once, str(tmp_path / "a")]], may_fail=(1,), restart=(1,)) == (0, None)
    always = [sys.executable, "-c", "raise SystemExit(7)"]
    assert run_together([ok, always], may_fail=(1,), restart=(1,)) == (7, 1)  # its second start failed too


@pytest.mark.multiprocess
def test_run_together_lets_a_node_lost_on_purpose_fail_and_keeps_the_others(tmp_path):
    from trainaccel.launch.local import run_together

    ok, lost = [sys.executable, "-c", "import time; time.sleep(1)"], [sys.executable, "-c", "raise SystemExit(9)"]
    assert run_together([ok, lost, ok], may_fail=(1,)) == (0, None)
    assert run_together([ok, lost, ok]) == (9, 1)  # otherwise the first failure stops the rest


@pytest.mark.bench_full
@pytest.mark.multiprocess
def test_a_tiny_run_of_every_arm_reports_curves_quality_and_bytes(tmp_path):
    out = tmp_path / "quality.json"
    proc = run(
        [
            *trainaccel_cmd(),
            "bench",
            "quality",
            "--task",
            "digits",
            "--steps",
            "6",
            "--eval-every",
            "3",
            "--repeats",
            "1",
            "--arms",
            "baseline,torch-fp16,trainaccel,local",
            "--variant",
            "fp16:compression=fp16",
            "--json",
            out,
            "--plot",
            tmp_path / "curves.png",
        ],
        env={"COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "baseline, repeat 1/1:" in proc.stdout and "speedup to target" in proc.stdout
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    report = json.loads(out.read_text())
    assert report["benchmark"] == "quality" and report["tolerance"] == 0.02
    arms = report["arms"]
    assert list(arms) == ["baseline", "torch-fp16", "trainaccel", "local", "fp16"]
    parameters = arms["baseline"]["parameters"]
    for arm in arms.values():
        (curve,) = arm["curves"]
        assert [c[0] for c in curve] == [0, 3, 6] and 0 < curve[1][1] < curve[2][1] == arm["median_seconds"]
        assert curve[0][2] == arms["baseline"]["curves"][0][0][2]  # one initial model for every arm
    # trainaccel with no options runs DDP's own allreduce: the very same trajectory as plain DDP.
    assert arms["trainaccel"]["curves"][0][1:] != [] and [c[2:] for c in arms["trainaccel"]["curves"][0]] == [
        c[2:] for c in arms["baseline"]["curves"][0]
    ]
    assert arms["baseline"]["speedup"] == 1.0 and arms["baseline"]["loss_vs_baseline"] == 0.0
    for arm in ("torch-fp16", "fp16"):  # half precision on the wire: close to plain DDP
        assert abs(arms[arm]["loss_vs_baseline"]) < 0.01
    assert arms["torch-fp16"]["bytes_per_step"] == parameters * 2
    # trainaccel's lossy codecs reduce the first step exactly (DDP's buckets are final after it), then 2 bytes each.
    assert arms["fp16"]["bytes_per_step"] == pytest.approx((parameters * 4 + 5 * parameters * 2) / 6, abs=1)
    assert arms["baseline"]["bytes_per_step"] == parameters * 4 and arms["local"]["bytes_per_step"] == 0
    assert arms["local"]["share_of_ceiling"] == 1.0 and report["arm_options"]["fp16"] == {"compression": "fp16"}


@pytest.mark.bench_full
@pytest.mark.multiprocess
def test_under_sync_every_validations_see_the_synced_model_and_only_the_last_averages(tmp_path):
    out = tmp_path / "quality.json"
    cmd = [*trainaccel_cmd(), "bench", "quality", "--task", "digits", "--steps", "8", "--eval-every", "3"]
    cmd += ["--repeats", "1", "--arms", "local", "--variant", "h4:sync_every=4", "--json", out]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (curve,) = json.loads(out.read_text())["arms"]["h4"]["curves"]
    assert [c[0] for c in curve] == [0, 3, 6, 8]
    # Step 3 comes before the first sync (step 4): a validation sees the synced model, still the initial one, and
    # averages nothing (an average there would show the replicas' three steps of training).
    assert curve[1][2:] == curve[0][2:]
    assert curve[2][2] != curve[0][2] and curve[3][2] < curve[0][2]


@pytest.mark.parametrize(
    "error, code, line",
    [
        (RuntimeError("arm 'x' failed"), 1, "error: arm 'x' failed"),
        (KeyboardInterrupt(), 130, "interrupted; workers stopped"),
    ],
)
def test_a_failed_or_interrupted_run_ends_with_its_exit_code_and_one_line(capsys, error, code, line):
    from trainaccel.bench.jobs import interleaved_or_exit_code

    def run_one(*args):
        raise error

    assert interleaved_or_exit_code("quality", "title", ["x"], 1, None, run_one, str) == (None, code)
    assert f"trainaccel bench quality: {line}" in capsys.readouterr().err


def test_a_plots_lines_are_named_in_words():
    """A reader of the results page sees what each line is, not the benchmark's arm names."""
    from trainaccel.bench.plot import arm_words

    assert arm_words("baseline") == "plain DDP"
    assert arm_words("torch-fp16") == "DDP + torch's fp16_compress_hook"
    assert arm_words("local") == "no communication (the ceiling)"
    assert arm_words("auto", {"sync_every": "auto"}) == "trainaccel run --sync-every auto"
    both = {"sync_every": "4", "outer_compression": "fp4"}
    assert arm_words("s4fp4", both) == "trainaccel run --sync-every 4 --outer-compression fp4"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sync_every": "4", "sync_fragments": "2", "outer_optimizer": "nesterov"}, None),
        ({}, "needs --sync-every N, an integer >= 1 (got 0"),
        ({"sync_every": "auto"}, "torchft has no sync_every=auto"),
        ({"sync_every": "4", "sync_fragments": "3"}, "needs --sync-fragments to divide --sync-every"),
        ({"sync_every": "4", "sync_warmup": "2"}, "no counterpart of --sync-warmup 2; it takes --sync-every"),
        ({"sync_every": "4", "outer_compression": "int8"}, "no counterpart of --outer-compression int8"),
        # torchft's fragment_sync_delay must end before the next fragment's sync starts.
        ({"sync_every": "4", "sync_fragments": "2", "sync_overlap": "2"}, "--sync-overlap (its fragment_sync_delay)"),
        ({"sync_every": "4", "fragment_update_alpha": "1.5"}, "invalid fragment_update_alpha='1.5'; accepted: a num"),
        ({"sync_every": "4", "fragment_update_alpha": "half"}, "invalid fragment_update_alpha='half'; accepted: a n"),
    ],
)
def test_the_torchft_arm_runs_trainaccels_diloco_options_or_says_which_it_cannot(monkeypatch, options, message):
    import importlib.util

    from trainaccel.bench import peers

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: object())  # installed or not
    if message is None:
        settings = peers.torchft_settings(options)
        assert settings == {
            "sync_every": 4,
            "sync_fragments": 2,
            "outer_optimizer": "nesterov",
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "sync_scope": "auto",
            "sync_overlap": 0,
            "fragment_update_alpha": 0.0,
        }
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        peers.torchft_settings(options)


def test_a_torchft_variant_takes_trainaccels_diloco_options_and_torchfts_own(monkeypatch):
    import importlib.util

    from trainaccel.bench import peers
    from trainaccel.bench.plot import arm_words

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: object())
    text = "torchft-d1:sync_every=10,sync_fragments=2,sync-overlap=1,fragment_update_alpha=0.5"
    assert peers.is_peer_variant(text) and peers.is_peer_variant("torchft:sync_every=4")
    assert not peers.is_peer_variant("torchftish:sync_every=4") and not peers.is_peer_variant("s4:sync_every=4")
    label, options = peers.parse_peer_variant(text)
    assert label == "torchft-d1"
    settings = peers.torchft_settings(options)
    assert (settings["sync_every"], settings["sync_fragments"], settings["sync_overlap"]) == (10, 2, 1)
    assert settings["fragment_update_alpha"] == 0.5
    assert arm_words(label, options).startswith("torchft's DiLoCo --sync-every 10 --sync-fragments 2")
    for bad, message in [
        ("torchft-:sync_every=4", "invalid --variant 'torchft-:sync_every=4'; accepted: torchft-LABEL:option=value"),
        ("torchft-x:compression=topk", "invalid option 'compression=topk' in --variant torchft-x; accepted: option="),
        ("torchft-x:sync_every", "invalid option 'sync_every' in --variant torchft-x"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            peers.parse_peer_variant(bad)


def test_torchft_variants_are_checked_before_any_worker_starts(monkeypatch, capsys):
    import importlib.util

    from trainaccel.bench import jobs, quality
    from trainaccel.cli import main

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: object())
    monkeypatch.setattr(jobs, "run_workers", lambda *a, **k: pytest.fail("a worker started"))
    monkeypatch.setattr(quality, "interleaved_or_exit_code", lambda *a, **k: pytest.fail("a run started"))
    bench = ["bench", "quality", "--arms", "baseline", "--repeats", "1"]
    twice = ["--variant", "torchft-a:sync_every=4", "--variant", "torchft-a:sync_every=8"]
    assert main([*bench, *twice]) == 2
    assert capsys.readouterr().err == "trainaccel bench quality: error: each --variant needs its own label\n"
    assert main([*bench, "--variant", "torchft-a:sync_every=4,fragment_update_alpha=2"]) == 2
    assert "invalid fragment_update_alpha='2'" in capsys.readouterr().err


def test_without_torchft_its_arm_is_refused_in_one_line_before_any_worker_starts(monkeypatch, capsys):
    import importlib.util

    from trainaccel.bench import jobs, quality
    from trainaccel.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "torchft" else find_spec(name))
    monkeypatch.setattr(jobs, "run_workers", lambda *a, **k: pytest.fail("a worker started"))
    monkeypatch.setattr(quality, "interleaved_or_exit_code", lambda *a, **k: pytest.fail("a run started"))
    assert main(["bench", "quality", "--arms", "baseline,torchft", "--sync-every", "4", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "trainaccel bench quality: error: the torchft arm needs torchft: pip install 'trainaccel[peers]'\n"


def test_torchft_replica_groups_are_trainaccels_replicas():
    from trainaccel.bench.emulate import Emulation
    from trainaccel.bench.peers import replica_groups
    from trainaccel.bench.plot import arm_words

    nodes = Emulation(2, 2, "100mbit")
    assert replica_groups(nodes, 2, "auto") == replica_groups(nodes, 2, "node") == [(0, 2), (1, 2)]
    assert replica_groups(nodes, 2, "rank") == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert replica_groups(Emulation(2, 1, "100mbit"), 2, "auto") == [(0, 1), (1, 1)]
    assert replica_groups(None, 3, "node") == [(0, 1)] * 3  # one machine: each worker a replica, as trainaccel's
    assert arm_words("torchft", {"sync_every": "4"}) == "torchft's DiLoCo --sync-every 4"


@pytest.mark.multiprocess
def test_the_torchft_arm_trains_reports_like_the_others_and_leaves_nothing_behind(tmp_path):
    pytest.importorskip("torchft", reason="the torchft arm needs torchft: pip install 'trainaccel[peers]'")
    import os
    import shutil
    import subprocess
    import time

    from trainaccel.bench.emulate import namespaces
    from trainaccel.bench.faults import ProcessTree

    out = tmp_path / "quality.json"
    cmd = [*trainaccel_cmd(), "bench", "quality", "--task", "digits", "--steps", "8", "--eval-every", "4"]
    cmd += ["--repeats", "1", "--arms", "trainaccel,torchft", "--sync-every", "2", "--outer-optimizer", "average"]
    # torchft's streaming: 2 fragments, each synced a step late, half of the steps meanwhile kept
    cmd += ["--variant", "torchft-d1:sync_every=4,sync_fragments=2,sync_overlap=1,fragment_update_alpha=0.5"]
    cmd += ["--json", out]
    emulated = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
    if emulated:  # the lighthouse in node 0's namespace, a replica group per node
        cmd += ["--emulate", "nodes=2,procs-per-node=1,link=1gbit"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tree = ProcessTree([proc.pid])
    try:
        while proc.poll() is None:
            tree.scan()
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=60)
        left = tree.alive()
    finally:
        tree.kill()
    assert proc.returncode == 0, stdout + stderr
    assert left == [], f"processes left behind: {left}"
    assert namespaces(f"ta{proc.pid}-") == []
    report = json.loads(out.read_text())
    assert report["arm_options"]["torchft"] == {"sync_every": "2", "outer_optimizer": "average"}
    mine, theirs = report["arms"]["trainaccel"], report["arms"]["torchft"]
    assert set(theirs) == set(mine)  # the table and the JSON treat it as any arm
    (curve,) = theirs["curves"]
    assert [c[0] for c in curve] == [0, 4, 8] and 0 < curve[1][1] < curve[2][1] == theirs["median_seconds"]
    assert curve[2][2] < curve[0][2] and theirs["parameters"] == mine["parameters"]
    assert theirs["bytes_per_step"] == mine["parameters"] * 4 / 2  # the model's float32 change every 2 steps
    # The same DiLoCo from the same model and batches: torchft's losses are trainaccel's, bit for bit.
    assert [c[2:] for c in curve] == [c[2:] for c in mine["curves"][0]]
    streamed = report["arms"]["torchft-d1"]
    assert report["arm_options"]["torchft-d1"]["fragment_update_alpha"] == "0.5"
    (curve,) = streamed["curves"]
    assert [c[0] for c in curve] == [0, 4, 8] and curve[2][2] < curve[0][2]
    # A fragment every 2 steps (the model every 4), and the final average of the live models (fragments trained since)
    assert streamed["bytes_per_step"] == mine["parameters"] * 4 * 3 / 8
