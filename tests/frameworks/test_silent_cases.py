"""Options a user asked for and nothing applied are said, in one line: workers stepping optimizers with no DDP model to
take the options (an Accelerate script without `cpu=True` on a machine without GPUs sees one worker and wraps nothing),
and TRAINACCEL_* variables in an environment whose launcher never starts trainaccel (`trainaccel info` says so)."""

from __future__ import annotations

import pytest

from conftest import SCRIPTS, run, trainaccel_cmd

SCRIPT = SCRIPTS / "nothing_takes_the_options.py"
SAID = "optimizer steps ran in this job of 2 workers and no DistributedDataParallel model"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mode, flags, expected",
    [
        ("accelerate", ["--compression", "fp16"], "took compression=fp16: not applied"),
        ("alone", ["--sync-every", "4", "--amp", "bf16"], "took sync_every=4 amp=bf16: not applied"),
        ("ddp", ["--compression", "fp16"], None),  # taken: nothing to say
    ],
)
def test_workers_stepping_with_nothing_taking_the_options_are_told_once(mode, flags, expected):
    cmd = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, *flags, SCRIPT, mode]
    proc = run(cmd, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if SAID in line]
    if expected is None:
        assert said == []
        return
    assert len(said) == 1 and "[trainaccel rank 0]" in said[0], said
    assert expected in said[0], said[0]
    if mode == "accelerate":
        assert "Accelerator(cpu=True)" in said[0]


@pytest.mark.multiprocess
def test_trainaccel_info_says_which_launchers_ignore_the_options_set_in_its_environment():
    env = {"TRAINACCEL_COMPRESSION": "fp16", "TRAINACCEL_AMP": "bf16"}
    proc = run([*trainaccel_cmd(), "info"], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "launchers start workers that ignore them" in line]
    assert len(lines) == 1, proc.stdout
    assert "TRAINACCEL_COMPRESSION=fp16, TRAINACCEL_AMP=bf16" in lines[0] and "accelerate launch" in lines[0]
    bare = run([*trainaccel_cmd(), "info"], timeout=120)  # none set: nothing said
    assert "ignore them" not in bare.stdout


def test_only_options_a_model_takes_are_named():
    from trainaccel.config import Config
    from trainaccel.zero_code import options_for_a_model

    assert options_for_a_model(Config()) == []  # nothing asked for: nothing to say
    assert options_for_a_model(Config.resolve(env={}, collective_timeout=60, log_level="debug")) == []
    given = Config.resolve(env={}, compression="fp16", amp="bf16", collective_timeout=60)
    assert options_for_a_model(given) == ["compression=fp16", "amp=bf16"]
