"""`trainaccel bench train` runs on a tiny configuration and writes well-formed JSON (no timing asserted)."""

import json

import pytest

from conftest import run, trainaccel_cmd
from trainaccel.bench.recsys import criteo_cardinalities

MLP_PARAMETERS = 18_834_408


@pytest.mark.bench_full
@pytest.mark.multiprocess
def test_bench_train_tiny_run_writes_well_formed_json_and_arms_see_only_their_options(tmp_path):
    # One run for both concerns (each arm is a 2-worker job): the report's shape, and the options each arm sees.
    out = tmp_path / "bench.json"
    proc = run(
        [
            *trainaccel_cmd(),
            "bench",
            "train",
            "--model",
            "mlp",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "4",
            "--arms",
            "baseline,torch-fp16,local",
            "--variant",
            "sparse:compression=randomk,compression-ratio=0.25",
            "--variant",
            "fast:amp=bf16",
            "--json",
            out,
            "--plot",
            tmp_path / "arms.png",
        ],
        env={"COLUMNS": "200", "TRAINACCEL_COMPRESSION": "bf16"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bench train mlp" in proc.stdout and "vs baseline" in proc.stdout
    assert "torch-fp16, repeat 1/1:" in proc.stdout  # a line per arm and repeat as they end
    assert (tmp_path / "arms.png").read_bytes().startswith(b"\x89PNG")
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train" and report["command"][:3] == ["trainaccel", "bench", "train"]
    assert report["settings"]["repeats"] == 1 and report["machine"]["cpus"] >= 1
    arms = report["arms"]
    assert sorted(arms) == ["baseline", "fast", "local", "sparse", "torch-fp16"]
    for arm in arms.values():
        assert len(arm["examples_per_s_per_worker"]) == 1
        assert 0 < arm["min"] <= arm["median"] <= arm["max"]
        assert arm["ratio_vs_baseline"] > 0 and arm["peak_memory_bytes"] > 0
        assert arm["parameters"] == MLP_PARAMETERS
    assert arms["baseline"]["ratio_vs_baseline"] == 1.0
    assert [arms[a]["amp"] for a in ("baseline", "sparse", "fast")] == [None, None, "bfloat16"]
    assert not any(arm["compiled"] for arm in arms.values())
    # Plain DDP, untouched by the env's compression=bf16, which reaches the trainaccel arms.
    assert arms["baseline"]["bytes_per_step"] == MLP_PARAMETERS * 4 and arms["baseline"]["comm_hook"] is None
    assert arms["fast"]["bytes_per_step"] == MLP_PARAMETERS * 2
    assert arms["fast"]["comm_hook"] == "trainaccel_comm_hook"
    assert arms["local"]["bytes_per_step"] == 0 and arms["local"]["comm_hook"] == "no_communication"
    # The strongest baseline without trainaccel: torch's own fp16 hook, half of every gradient.
    assert arms["torch-fp16"]["bytes_per_step"] == MLP_PARAMETERS * 2
    assert arms["torch-fp16"]["comm_hook"] == "fp16_compress_hook"
    # The variant's flags beat the env; randomk sends every 4th element of each bucket.
    assert abs(arms["sparse"]["bytes_per_step"] - MLP_PARAMETERS) <= 16
    assert report["arm_options"]["sparse"] == {"compression": "randomk", "compression_ratio": "0.25"}


def test_summaries_pair_each_repeat_with_the_baselines_and_take_medians():
    from trainaccel.bench.train import summarize

    def result(rate: float, loss: float) -> dict:
        return {
            "examples_per_s_per_worker": rate,
            "bytes_per_step": 8.0,
            "peak_memory_bytes": int(rate),
            "comm_hook": None,
            "parameters": 3,
            "amp": None,
            "compiled": False,
            "final_loss": loss,
        }

    runs = {
        "baseline": [result(10, 1.0), result(20, 2.0), result(40, 3.0)],
        "trainaccel": [result(30, 0.5), result(40, 1.0), result(40, 9.0)],
        "local": [result(50, 0.1), result(100, 0.1), result(200, 0.1)],
    }
    summary = summarize(runs)
    ours = summary["trainaccel"]
    assert (ours["median"], ours["min"], ours["max"]) == (40, 30, 40)
    assert ours["ratio_vs_baseline"] == 2.0  # paired per repeat: 3.0, 2.0, 1.0 -> 2.0 (not 40 / 20)
    assert ours["share_of_local"] == 0.4  # 0.6, 0.4, 0.2
    assert ours["final_loss"] == 1.0 and ours["peak_memory_bytes"] == 40


def test_bench_train_rejects_bad_arguments(capsys):
    from trainaccel.cli import main

    for args, message in [
        (["--arms", "baseline,fast"], "invalid --arms 'baseline,fast'"),
        (
            ["--model", "deepfm", "--arms", "local"],
            "invalid --arms 'local' for deepfm; accepted: a comma-separated subset of baseline, trainaccel",
        ),
        (["--repeats", "0"], "invalid --repeats 0; accepted: an integer >= 1"),
        (["--compression", "zip"], "invalid compression='zip' (from --compression)"),
        (["--variant", "local:compression=fp16"], "invalid --variant 'local:compression=fp16'"),
        (["--variant", "x:compresion=fp16"], "invalid option 'compresion=fp16' in --variant x"),
        (["--variant", "x:compression_ratio=2"], "--variant x: invalid compression_ratio='2'"),
        (["--amp", "fp8"], "invalid amp='fp8' (from --amp)"),
        (["--variant", "x:amp_policy=lr"], "--variant x: invalid amp_policy='lr'"),
    ]:
        assert main(["bench", "train", *args]) == 2  # in this process: it fails before starting any worker
        assert message in capsys.readouterr().err


@pytest.mark.bench_full  # a full smoke run of `bench train --model deepfm` (25 s); the model's own tests are in CI
@pytest.mark.multiprocess
def test_bench_train_deepfm_runs_both_arms(tmp_path):
    out = tmp_path / "deepfm.json"
    proc = run(
        [
            *trainaccel_cmd(),
            "bench",
            "train",
            "--model",
            "deepfm",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "64",
            "--max-rows",
            "1000",
            "--embedding-dim",
            "4",
            "--json",
            out,
        ],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["baseline", "trainaccel"]
    base, ours = arms["baseline"], arms["trainaccel"]
    tables = sum(criteo_cardinalities(1000))
    assert base["bytes_per_step"] == base["parameters"] * 4  # plain DDP allreduces the tables too
    assert base["parameters"] - ours["parameters"] == tables * 5  # the trainaccel arm keeps them out of DDP
    assert 0 < ours["embedding_rows"] <= tables and 0 < ours["bytes_per_step"] < base["bytes_per_step"]
    assert all(0 < a["final_loss"] < 5 for a in arms.values())


def test_auto_choices_are_kept_for_the_result_and_printed_under_the_table():
    import logging

    from rich.console import Console

    from trainaccel.bench.jobs import print_auto_lines
    from trainaccel.bench.train import summarize
    from trainaccel.bench.worker import auto_lines
    from trainaccel.config import Config

    log = logging.getLogger("trainaccel")
    level = log.level
    said, ignored = auto_lines(Config.resolve(env={}, sync_every="auto")), auto_lines(Config.resolve(env={}))
    try:
        log.info("sync_every=auto: H=4, 2 fragments, overlap 1, fp4 (step 0.1 s)")
        log.info("trainaccel config: sync_every=auto")
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    assert said.lines == ["sync_every=auto: H=4, 2 fragments, overlap 1, fp4 (step 0.1 s)"]
    assert ignored.lines == [] and ignored not in log.handlers  # sync_every not auto: not attached

    def result(lines: list[str]) -> dict:
        keys = ("bytes_per_step", "peak_memory_bytes", "comm_hook", "parameters", "amp", "compiled", "final_loss")
        return {"examples_per_s_per_worker": 1.0, **dict.fromkeys(keys, 0), "auto_settings": lines}

    summary = summarize({"auto": [result(said.lines), result(["sync_every=auto: H=3"])], "plain": [result([])]})
    assert summary["auto"]["auto_settings"] == [said.lines, ["sync_every=auto: H=3"]]
    assert "auto_settings" not in summary["plain"]
    console = Console(record=True, width=200)
    print_auto_lines(console, summary)
    assert console.export_text().splitlines() == [
        "auto, repeat 1: sync_every=auto: H=4, 2 fragments, overlap 1, fp4 (step 0.1 s)",
        "auto, repeat 2: sync_every=auto: H=3",
    ]
