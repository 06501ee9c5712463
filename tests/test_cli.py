import json
import os
import sys

import pytest
import torch

from conftest import run, trainaccel_cmd
from trainaccel.bench.emulate import namespaces, why_not_emulated


@pytest.mark.multiprocess
def test_info_reports_versions_backends_and_config():
    proc = run(
        [*trainaccel_cmd(), "info"], env={"TRAINACCEL_COMPRESSION": "fp16", "TRAINACCEL_TYPO": "1", "COLUMNS": "200"}
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert torch.__version__ in out and "gloo=yes" in out
    assert "config.compression" in out and "fp16  (TRAINACCEL_COMPRESSION)" in out
    assert "config.nan_check" in out and "off  (default)" in out
    assert "TRAINACCEL_TYPO is not a trainaccel option" in out


def test_info_rejects_a_bad_env_value(cli):
    proc = cli(["info"], env={"TRAINACCEL_HIERARCHICAL": "sideways"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "trainaccel info: error: invalid hierarchical='sideways' (from TRAINACCEL_HIERARCHICAL); accepted: auto, on, off"
    )


@pytest.mark.multiprocess
def test_version_and_usage():
    proc = run([*trainaccel_cmd(), "--version"])
    assert proc.returncode == 0 and proc.stdout.startswith("trainaccel 0.")
    proc = run([*trainaccel_cmd()])
    assert proc.returncode == 2 and "run" in proc.stderr and "demo" in proc.stderr
    # Only the command named loads its module: the version, the usage and `bench -h` need no torch.
    proc = run([sys.executable, "-c", PROBE.format('["--version"], [], ["bench", "-h"]')])
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
    proc = run([sys.executable, "-c", PROBE.format('["bench", "quality", "-h"],')])
    assert "--task" in proc.stdout and proc.stdout.strip().splitlines()[-1] == "['torch', 'trainaccel.bench.quality']"


# Runs the CLI on each argv of {} in one process, then prints which of the heavy modules it loaded.
PROBE = """
import sys
from trainaccel.cli import main
for argv in ({}):
    try:
        main(argv)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "trainaccel.bench.quality") if m in sys.modules))
"""


@pytest.mark.multiprocess
def test_demo_measures_every_arm(tmp_path):
    out = tmp_path / "demo.json"
    command = [*trainaccel_cmd(), "demo", "--loopback", "--steps", "12", "--warmup", "4", "--json", out]
    proc = run(command, env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainaccel demo" in proc.stdout and "examples/s per worker" in proc.stdout
    # Where it cannot show the gain, it says why and names the command that does.
    assert "No emulated slow link here (--loopback was given)" in proc.stdout
    assert "sudo trainaccel bench quality --task digits --emulate nodes=2,procs-per-node=1,link=500mbit" in proc.stdout
    plain, default, fp16 = json.loads(out.read_text())["arms"]
    names = ["plain DDP (torchrun)", "trainaccel run", "trainaccel run --compression fp16"]
    assert [a["arm"] for a in (plain, default, fp16)] == names
    assert plain["comm_hook"] is None
    assert default["comm_hook"] == "BuiltinCommHookType.ALLREDUCE"  # defaults, one node: DDP's own allreduce
    assert fp16["comm_hook"] == "trainaccel_comm_hook"
    for arm in (plain, default, fp16):
        assert arm["world_size"] == 2 and arm["timed_steps"] == 8
        assert arm["examples_per_s_per_worker"] > 0
        assert arm["replica_max_abs_diff"] == 0
        assert arm["final_loss"] < arm["first_loss"]
    assert default["bytes_per_step"] == plain["bytes_per_step"]
    assert fp16["bytes_per_step"] == plain["bytes_per_step"] / 2


@pytest.mark.bench_full
@pytest.mark.multiprocess
@pytest.mark.skipif(why_not_emulated() is not None, reason="needs root and iproute2 to build network namespaces")
def test_demo_on_a_slow_link_reports_time_and_validation_loss_per_arm(tmp_path):
    pytest.importorskip("sklearn")
    out, before = tmp_path / "demo.json", set(namespaces("ta"))
    proc = run([*trainaccel_cmd(), "demo", "--steps", "12", "--json", out], env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    # What will run and for how long comes first; the table leads with the arm that wins, every arm in words.
    assert text.startswith("trainaccel demo: one DDP script, unchanged,") and "seconds in all" in text[:600], text[:600]
    assert "2 nodes x 1 workers, link 500mbit" in text and "validation loss" in text
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    words = ["trainaccel run --sync-every auto", "DDP + torch's fp16_compress_hook", "plain DDP", "no communication"]
    assert [next(w for w in words if w in row) for row in rows] == words, rows
    assert text.rstrip().endswith("trainaccel run --nproc-per-node 8 --sync-every auto --metrics-every 100 train.py")
    report = json.loads(out.read_text())
    arms = report["arms"]
    assert list(arms) == ["auto", "torch-fp16", "baseline", "local"]
    for arm in arms.values():
        assert len(arm["seconds"]) == 1 and arm["median_seconds"] > 0 and arm["validation_loss"] > 0
    assert set(namespaces("ta")) <= before, "the emulated cluster was not removed"


def test_demo_rejects_bad_arguments(cli):
    proc = cli(["demo", "--steps", "5", "--warmup", "5"])
    assert proc.returncode == 2 and "accepted: 0 <= warmup < steps" in proc.stderr


@pytest.mark.multiprocess
def test_commands_start_without_the_data_extra(tmp_path):
    """`pip install -e .` has no crc32c, protobuf or Pillow: only the data commands need them, and say so."""
    code = (
        "import sys\n"
        "for m in ('crc32c', 'google.protobuf', 'PIL'): sys.modules[m] = None\n"
        "from trainaccel.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    script = tmp_path / "no_extra.py"
    script.write_text(code)
    assert run([sys.executable, script, "demo", "--help"]).returncode == 0
    proc = run([sys.executable, script, "pack", "imagefolder", tmp_path, tmp_path / "out"])
    assert proc.returncode == 2 and "pip install 'trainaccel[data]'" in proc.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["run"],
        ["info"],
        ["demo"],
        ["bench", "train"],
        ["bench", "comm"],
        ["bench", "data"],
        ["bench", "embedding"],
        ["pack", "imagefolder"],
    ],
)
def test_every_command_prints_its_help(command, capsys):
    from trainaccel.cli import main
    from trainaccel.launch.run import main as run_main

    with pytest.raises(SystemExit) as exit_:
        (run_main(["--help"]) if command == ["run"] else main([*command, "--help"]))
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


SCRIPT = "tests/scripts/plain_ddp.py"
BAD_INPUTS = [  # (argv, env, what the first line must say)
    (["frobnicate"], {}, "trainaccel: error: argument {run,info,demo,bench,pack}: invalid choice: 'frobnicate'"),
    (["bench", "quallity"], {}, "trainaccel bench: error: argument {quality,"),
    (["bench", "train", "--stepz", "3"], {}, "unrecognized arguments: --stepz 3 (did you mean --steps?)"),
    (["pack", "coco"], {}, "trainaccel pack coco: error: the following arguments are required: annotations"),
    (["pack", "coco", "--shard-sise", "3", "a", "b"], {}, "(did you mean --shard-size?)"),
    (["info", "--verbose"], {}, "trainaccel info: error: unrecognized arguments: --verbose"),
    (["info"], {"TRAINACCEL_HIERARCHICAL": "sideways"}, "invalid hierarchical='sideways' (from TRAINACCEL_HIER"),
    (["demo", "--stesp", "3"], {}, "trainaccel demo: error: unrecognized arguments: --stesp 3 (did you mean --steps?)"),
    (["run", "--compresion", "fp16", SCRIPT], {}, "unrecognized arguments: --compresion (did you mean --compression?)"),
    (["run", "--nproc-per-node", "2", "nothere.py"], {}, "trainaccel run: error: no training script 'nothere.py'"),
    (["run", "-m", "not.a.module"], {}, "trainaccel run: error: no module 'not.a.module' to run (-m)"),
    (["run", "--compression", "zip", SCRIPT], {}, "invalid compression='zip' (from --compression); accepted: none,"),
    (["run", SCRIPT], {"TRAINACCEL_COMPRESION": "fp16"}, "TRAINACCEL_COMPRESION is not a trainaccel option (did you"),
    (["run", SCRIPT], {"TRAINACCEL_UNKNOWN_ENV": "maybe"}, "invalid unknown_env='maybe' (from TRAINACCEL_UNKNOWN_EN"),
    (["run", "--sync-every", "-3", SCRIPT], {}, "trainaccel run: error: invalid sync_every="),
    (["run", "--sync-fragments", "2", SCRIPT], {}, "invalid sync_fragments=2; accepted: 1 without sync_every"),
    (["run", "--on-lost-replica", "continue", "--compression", "fp16", SCRIPT], {}, "invalid compression='fp16'; acc"),
    (["run", "--sync-every", "4", "--compression", "fp16", SCRIPT], {}, "invalid compression='fp16'; accepted: none"),
    (["run", "--compression", "topk", "--compression-ratio", "2", SCRIPT], {}, "invalid compression_ratio="),
]


@pytest.mark.parametrize("argv, env, said", BAD_INPUTS, ids=[" ".join(a)[:40] for a, _, _ in BAD_INPUTS])
def test_bad_input_is_answered_in_at_most_three_lines_without_a_traceback(argv, env, said, monkeypatch, capsys):
    """In this process, as the command's entry point runs it (two cases below as real processes)."""
    from trainaccel.cli import main

    for name in [n for n in os.environ if n.startswith("TRAINACCEL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip().splitlines()
    assert code == 2, out
    assert len(out) <= 3 and not any("Traceback" in line for line in out), out
    assert said in out[0], out


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [1, 8, 12], ids=["bench", "run flag", "run env"])
def test_bad_input_from_the_command_itself(case):
    argv, env, said = BAD_INPUTS[case]
    proc = run([*trainaccel_cmd(), *argv], env=env, timeout=60)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(out) <= 3 and said in out[0], out


@pytest.mark.parametrize("argv", [["bench"], ["bench", "train"], ["pack", "coco"], ["demo"]])
def test_each_command_shows_its_own_usage(cli, argv):
    """Not the root's command list: argparse names a subcommand by the parent's usage unless told its prog."""
    proc = cli([*argv, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: trainaccel {' '.join(argv)} "), proc.stdout[:300]


def test_run_help_shows_the_options_by_topic_before_torchruns_with_choices_and_defaults(capsys):
    from trainaccel.config import TOPICS, Config
    from trainaccel.launch.run import main as run_main

    with pytest.raises(SystemExit):
        run_main(["--help"])
    text = capsys.readouterr().out
    titles = [*(f"\n{topic}:\n" for topic in TOPICS), "\ntorchrun's options (as torchrun takes them):\n"]
    places = [text.find(title) for title in titles]
    assert -1 not in places and places == sorted(places), places
    assert sorted(n for names in TOPICS.values() for n in names) == sorted(Config.option_names())
    for topic, names in TOPICS.items():
        section = text[text.find(f"\n{topic}:\n") :]
        for name in names:
            assert Config.flag_name(name) in section.split("\n\n")[0], (topic, name)
    assert "--outer-compression {none,bf16,fp16,int8,fp4}" in text and "--sync-every {auto}|N" in text
    assert "VALUE" not in text.replace("--amp-policy VALUE", "")
    flat = " ".join(text.split())
    assert "[default: none]" in flat and "[a number in (0, 1]; default: 0.01]" in flat
    assert "--sync_every" not in text  # the underscore spelling works but is not shown twice
