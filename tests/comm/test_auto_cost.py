"""The figures sync_every's one-time warning quotes are the results page's ten-seed medians for `auto`."""

import re
from pathlib import Path

from trainaccel.comm import diloco

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.md"


def ten_seed_medians() -> dict[str, dict[int, list[float]]]:
    """scope -> examples per worker -> the loss medians (% above plain DDP) of the page's `auto` ten-seed table."""
    lines = RESULTS.read_text().splitlines()
    start = lines.index(
        "| batch (step) | link | of the ceiling, median (seeds) | loss vs plain DDP, median (seeds) | what `auto` chose |"
    )
    found: dict[str, dict[int, list[float]]] = {"node": {}, "rank": {}}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        batch = int(re.match(r"\d+", cells[0]).group())
        scope = "node" if "2x2" in cells[0] else "rank"
        median = float(re.search(r"[+-]\d+\.\d+(?=%)", cells[3]).group())
        found[scope].setdefault(batch, []).append(median)
    return found


def test_warning_quotes_the_pages_medians():
    found = ten_seed_medians()
    assert found["rank"] and found["node"], found
    page = {scope: {b: (min(m), max(m)) for b, m in sorted(rows.items())} for scope, rows in found.items()}
    assert diloco.AUTO_COST == page


def test_warning_says_every_batch():
    for scope, costs in diloco.AUTO_COST.items():
        said = diloco.MEASURED[scope]
        assert f"at {next(iter(costs))} examples per worker" in said, said
        for batch, (lo, hi) in costs.items():
            figure = f"{lo:.1f}%" if lo == hi else f"{lo:.1f}-{hi:.1f}%"
            assert f"{figure} at {batch}" in said or f"{figure} above plain DDP's validation loss at {batch}" in said
