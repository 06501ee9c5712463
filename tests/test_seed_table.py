"""tools/seed_table.py: the per-seed figures the benchmark docs quote, against hand-computed ones."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("seed_table", ROOT / "tools" / "seed_table.py")
seed_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(seed_table)

SETTINGS = {
    "task": "text",
    "steps": 300,
    "batch_size": 4,
    "eval_every": 30,
    "emulate": "nodes=2,procs-per-node=1,link=100mbit",
}


def arm(seconds, losses):
    # A curve's points are (step, seconds, validation loss, accuracy); only the last one's loss counts.
    return {
        "seconds": seconds,
        "curves": [[[0, 0.0, 9.0, 0.0], [300, s, loss, 0.4]] for s, loss in zip(seconds, losses)],
    }


def run(arms, cpu="AVX512", **settings):
    return {"settings": {**SETTINGS, **settings}, "arms": arms, "machine": {"cpu_capability": cpu}}


def test_shares_pair_seeds_with_the_ceiling_and_losses_with_plain_ddp():
    local = arm([10.0, 12.0, 9.0], [2.9, 2.8, 2.7])
    auto = arm([12.5, 12.0, 10.0], [2.2, 2.53, 2.4])
    # More seeds than the run (the first ones count), over a faster link (the same losses).
    base = run({"baseline": arm([50.0] * 4, [2.0, 2.3, 2.5, 9.9])}, emulate="nodes=2,procs-per-node=1,link=10gbit")
    (row,) = seed_table.rows(run({"local": local, "auto": auto}), base)
    assert row["arm"] == "auto"
    assert row["share"] == pytest.approx([0.8, 1.0, 0.9])
    assert row["loss"] == pytest.approx([0.1, 0.1, -0.04])
    lines = seed_table.table([row]).splitlines()
    assert lines == [
        "| auto: of the ceiling | 80.0% | 100.0% | 90.0% | **90.0%** |",
        "| auto: loss vs plain DDP | +10.0% | +10.0% | -4.0% | **+10.0%** |",
    ]


def test_the_runs_own_baseline_wins_and_no_ceiling_leaves_the_share_out():
    own = arm([30.0], [2.0])
    other = run({"baseline": arm([30.0], [1.0])})
    (row,) = seed_table.rows(run({"baseline": own, "fp4": arm([20.0], [2.2])}), other)
    assert "share" not in row and row["loss"] == pytest.approx([0.1])


@pytest.mark.parametrize(
    "baseline, message",
    [
        (run({"baseline": arm([1.0], [2.0])}, steps=200), "the baseline's steps=200 differs from the run's 300"),
        (run({"baseline": arm([1.0], [2.0])}, task="digits"), "the baseline's task='digits' differs"),
        (
            run({"baseline": arm([1.0], [2.0])}, emulate="nodes=2,procs-per-node=2,link=10gbit"),
            "the baseline's workers='2x2' differs from the run's '2x1'",
        ),
        (run({"baseline": arm([1.0], [2.0])}, emulate=None), "the baseline's workers='1xNone' differs"),
        (run({"baseline": arm([1.0], [2.0])}, cpu="AVX2"), "the baseline's cpu_capability='AVX2' differs from the"),
        (run({"auto": arm([1.0, 1.0], [2.0, 2.0])}), "the baseline run has no 'baseline' arm; its arms: auto"),
        (run({"baseline": arm([1.0], [2.0])}), "the baseline has 1 seeds, the run 2; accepted: at least as many"),
    ],
)
def test_a_baseline_that_cannot_pair_is_refused_naming_why(baseline, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        seed_table.rows(run({"auto": arm([1.0, 1.0], [2.0, 2.0])}), baseline)


def test_the_command_prints_the_table_or_one_line_and_exit_code_2(tmp_path, capsys):
    path, base = tmp_path / "run.json", tmp_path / "base.json"
    path.write_text(json.dumps(run({"local": arm([9.0], [2.9]), "auto": arm([10.0], [2.2])})))
    base.write_text(json.dumps(run({"baseline": arm([40.0], [2.0])})))
    assert seed_table.main([str(path), "--baseline", str(base)]) == 0
    assert "| auto: loss vs plain DDP | +10.0% | **+10.0%** |" in capsys.readouterr().out
    base.write_text(json.dumps(run({"baseline": arm([40.0], [2.0])}, eval_every=10)))
    assert seed_table.main([str(path), "--baseline", str(base)]) == 2
    assert capsys.readouterr().err.startswith("seed_table: the baseline's eval_every=10 differs")
