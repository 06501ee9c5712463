"""tools/peer_table.py: the torchft table's figures against hand-computed ones."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("peer_table", ROOT / "tools" / "peer_table.py")
peer_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer_table)


def arm(*repeats, bytes_per_step=None):
    """An arm from each repeat's validations as (seconds, loss) after step 0; the last one is the final loss."""
    curves = [[[0, 0.0, 9.0, 0.0]] + [[30 * (i + 1), s, loss, 0.4] for i, (s, loss) in enumerate(r)] for r in repeats]
    seconds = [r[-1][0] for r in repeats]
    return {
        "seconds": seconds,
        "median_seconds": sorted(seconds)[len(seconds) // 2],
        "bytes_per_step": bytes_per_step,
        "curves": curves,
    }


def run(**arms):
    # (the bench's own target, `tolerance`, is not the table's: plain DDP's loss + 1%)
    return {"settings": {"steps": 300, "repeats": 3}, "tolerance": 0.02, "arms": arms}


RUN = run(
    baseline=arm([(50, 2.2), (100, 2.0)], [(50, 2.3), (100, 2.1)], [(50, 2.1), (100, 1.9)], bytes_per_step=2**20),
    local=arm([(10, 2.5), (20, 2.3)], [(12, 2.5), (24, 2.4)], [(10, 2.4), (20, 2.2)]),
    auto=arm([(11, 2.02), (25, 2.0)], [(12, 2.15), (25, 2.1)], [(13, 1.96), (25, 1.9)], bytes_per_step=2**18),
    **{
        "torchft-h4": arm([(40, 2.1), (80, 2.05)], [(40, 2.2), (80, 2.15)], [(40, 2.0), (80, 1.95)]),
        "torchft-h10": arm([(20, 2.2), (40, 2.1)], [(20, 2.3), (40, 2.2)], [(20, 2.2), (40, 2.0)]),
        "same-h4": arm([(39, 2.1), (79, 2.05)], [(41, 2.2), (81, 2.15)], [(40, 2.0), (80, 1.96)]),
    },
)


def test_rows_pair_repeats_with_plain_ddp_and_the_ceiling():
    by = {row["arm"]: row for row in peer_table.rows(RUN)}
    auto = by["auto"]
    # targets 2.02, 2.121, 1.919: auto reaches them at 11, 25 (2.15 > 2.121), 25 s
    assert auto["to_target"] == 25 and auto["reached"] == 3
    assert auto["vs_baseline"] == pytest.approx(0.0)  # 0%, 0%, 0%
    assert auto["share"] == pytest.approx(0.8)  # 20/25, 24/25, 20/25
    assert auto["mib"] == pytest.approx(300 / 4)
    assert by["torchft-h10"]["reached"] == 0 and by["torchft-h10"]["to_target"] is None
    assert "share" not in by["local"]


def test_torchfts_best_is_its_lowest_loss_and_auto_is_timed_to_reach_it():
    assert peer_table.best_torchft(RUN) == "torchft-h4"
    got = peer_table.against_best(RUN, "torchft-h4")
    # targets 2.05, 2.15, 1.95: auto at 11, 12 (2.15 reached, not passed), 25 s (1.96 is not) against torchft's 80 s
    assert got["times"] == [(11, 80), (12, 80), (25, 80)]
    assert got["ratio"] == pytest.approx(12 / 80) and got["met"]
    # final losses 2.0, 2.1, 1.9 against 2.05, 2.15, 1.95: the medians' ratio, each repeat below
    assert got["gap"] == pytest.approx(2.0 / 2.05 - 1) and got["below"] == 3


def test_a_goal_no_arm_can_meet_says_so(tmp_path, capsys):
    slow = dict(RUN["arms"], local=arm([(30, 2.5), (45, 2.3)], [(30, 2.5), (45, 2.4)], [(30, 2.4), (45, 2.2)]))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run(**slow)))
    assert peer_table.main([str(path)]) == 0
    assert "no arm can meet it: the ceiling's whole run took 0.56x its time" in capsys.readouterr().out  # 45 / 80


def test_the_fastest_torchft_is_the_soonest_to_plain_ddps_loss_of_those_reaching_it_every_time():
    found = [
        {"arm": "torchft-a", "to_target": 30.0},
        {"arm": "torchft-b", "to_target": 20.0},
        {"arm": "torchft-c", "to_target": None},
        {"arm": "auto", "to_target": 5.0},
    ]
    assert peer_table.fastest_torchft(found) == "torchft-b"
    assert peer_table.fastest_torchft(found[2:]) is None


def test_a_best_by_both_readings_is_said_once(tmp_path, capsys):
    reached = dict(RUN["arms"], **{"torchft-h4": arm([(40, 2.0), (80, 1.9)], [(40, 2.1), (80, 2.0)], [(40, 1.9)] * 2)})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run(**reached)))
    assert peer_table.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "torchft's fastest to plain DDP's loss + 1%: torchft-h4, its lowest loss too" in out
    assert out.count("auto did not reach its loss") == 1


def test_bit_for_bit_counts_repeats_equal_at_every_validation():
    assert peer_table.same_pairs(RUN, []) == [("same-h4", "torchft-h4")]
    equal, total, worst = peer_table.bit_for_bit(RUN, "same-h4", "torchft-h4")
    assert (equal, total) == (2, 3) and worst == pytest.approx(1.96 / 1.95 - 1)


def test_the_command_prints_the_table_and_refuses_a_run_it_cannot_read(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(RUN))
    assert peer_table.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| auto | 25.0 s | 25.0 s | 2.0000 | +0.0% | 80% | 75.0 |" in out
    assert "| torchft-h10 | 40.0 s | 0 of 3 reached |" in out
    assert "torchft's lowest loss: torchft-h4; auto reached its loss in 0.15x its time (goal 0.5x: met;" in out
    assert "torchft's fastest to plain DDP's loss + 1%: none reached it in every repeat" in out
    assert "no arm can meet it" not in out  # the ceiling took 20 s against torchft's 80
    assert "same-h4 vs torchft-h4: equal at every validation in 2 of 3 repeats" in out
    path.write_text(json.dumps(run(baseline=RUN["arms"]["baseline"], auto=RUN["arms"]["auto"])))
    assert peer_table.main([str(path)]) == 2
    assert capsys.readouterr().err == "peer_table: the run has no torchft arm; its arms: baseline, auto\n"
    path.write_text(json.dumps(RUN))
    assert peer_table.main([str(path), "--same", "same-h4=torchft-h2"]) == 2
    assert "no arm 'torchft-h2' to pair (same-h4=torchft-h2)" in capsys.readouterr().err
