"""`trainaccel bench embedding` on a tiny setting: the arms run, the key check passes and is reported."""

import json

import pytest

from trainaccel.bench.embedding import insert_check, torchrec_available
from trainaccel.cli import main


@pytest.mark.multiprocess  # the arms run in a process pool
def test_the_arms_run_and_report_lookups(tmp_path, capsys):
    report = tmp_path / "embedding.json"
    code = main(
        [
            "bench",
            "embedding",
            "--batch-size",
            "256",
            "--max-rows",
            "500",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--arms",
            "baseline,torch-sparse,trainaccel,torchrec",
            "--insert-keys",
            "5000",
            "--json",
            str(report),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "trainaccel, repeat 2/2:" in out and "M lookups/s" in out  # a line per arm and repeat as it ends
    result = json.loads(report.read_text())
    assert set(result["arms"]) == {"baseline", "torch-sparse", "trainaccel"} | (
        {"torchrec"} if torchrec_available() is None else set()
    )
    assert all(len(a["lookups_per_s"]) == 2 and a["median"] > 0 for a in result["arms"].values())
    assert result["arms"]["trainaccel"]["ratio_vs_baseline"] > 0
    check = result["insert_check"]
    assert (
        check["every_key_has_its_own_row"] and check["every_row_holds_its_keys_initial_value"] and check["rows"] == 5000
    )
    if torchrec_available() is not None:
        assert "torchrec" in result["skipped"] and "not run" in out


def test_the_key_check_sees_a_collision(monkeypatch):
    """A table that hands two keys one row must fail the check."""
    from trainaccel.embedding import DynamicEmbedding

    original = DynamicEmbedding._find_rows
    monkeypatch.setattr(DynamicEmbedding, "_find_rows", lambda self, keys: original(self, keys) // 2 * 2)
    assert not insert_check(1000, 4)["every_key_has_its_own_row"]


@pytest.mark.parametrize(
    "argv, match", [(["--arms", "gpu"], "invalid --arms 'gpu'"), (["--alpha", "1"], "invalid --alpha 1.0")]
)
def test_bad_arguments(argv, match, capsys):
    assert main(["bench", "embedding", *argv]) == 2
    assert match in capsys.readouterr().err
