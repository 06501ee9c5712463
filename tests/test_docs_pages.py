"""The results page and the decision guide stay whole: docs/results.md is short and its plots are there, every file
under docs/results/ is used by a page or a test, no page links to the retired notebook or to a result that is gone,
and every gain or cost in docs/guide.md's table links to the section of docs/results.md that measured it."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS_DIR = DOCS / "results"
RESULTS_PAGE = DOCS / "results.md"
GUIDE = DOCS / "guide.md"

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")  # [text](target), images included
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
FIGURE = re.compile(r"[+-]?\d+(?:\.\d+)?[x%](?!\w)")  # 1.99x, +0.4%, 89%


# What the walk leaves out: hidden folders (.git, .venv, caches) and what .gitignore keeps out of the repository.
SKIPPED = {"__pycache__", "build", "dist", "site", "wheels", "gpu-report", "node_modules"}


def _repo_files() -> list[Path]:
    """The repository's own files, found by a walk (no git process: these tests stay in-process)."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [
            d for d in subfolders if not d.startswith(".") and d not in SKIPPED and not d.endswith(".egg-info")
        ]
        found.extend(Path(folder) / name for name in files)
    return found


def _markdown_files() -> list[Path]:
    return [p for p in _repo_files() if p.suffix == ".md"]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # a `#` comment in a code block is not a heading
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M)}


def test_the_results_page_is_short_and_its_plots_are_there():
    text = RESULTS_PAGE.read_text()
    assert len(text.splitlines()) <= 420, len(text.splitlines())
    images = IMAGE.findall(text)
    assert images, "the results page shows its plots"
    for target in images:
        assert (RESULTS_PAGE.parent / target).is_file(), target


def test_every_result_file_is_used_by_a_page_or_a_test():
    texts = [p.read_text(errors="replace") for p in _markdown_files()]
    texts += [p.read_text(errors="replace") for p in _repo_files() if p.parts[len(ROOT.parts)] == "tests"]
    named = set()
    for text in texts:
        named.update(re.findall(r"results/([\w.+-]+)", text))
        for stem, endings in re.findall(r"results/([\w.+-]*)\{([^}]*)\}", text):  # faults-defaults.{log,json}
            named.update(stem + ending.strip() for ending in endings.split(","))
    orphans = sorted(p.name for p in RESULTS_DIR.iterdir() if p.is_file() and p.name not in named)
    assert not orphans, f"files under docs/results/ that no page or test uses: {orphans}"


def test_no_page_links_to_the_retired_notebook_or_a_missing_result():
    bad = []
    for page in _markdown_files():
        for _, target in LINK.findall(page.read_text(errors="replace")):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if path.name == "BENCHMARKS.md" or (RESULTS_DIR in path.parents and not path.exists()):
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, bad


def test_every_figure_in_the_guides_table_links_to_the_section_that_measured_it():
    anchors = _anchors(RESULTS_PAGE.read_text())
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("|") and not line.startswith("|--")]
    assert len(rows) >= 8, "a header and a row per setting"
    unlinked = []
    for row in rows:
        links = [(m.start(1), m.end(1), m.group(2)) for m in LINK.finditer(row)]
        for figure in FIGURE.finditer(row):
            around = [target for start, end, target in links if start <= figure.start() and figure.end() <= end]
            target = around[0] if around else ""
            page, _, anchor = target.partition("#")
            if page != "results.md" or anchor not in anchors:
                unlinked.append(f"{figure.group()} ({target or 'no link'}) in: {row[:60]}")
    assert not unlinked, unlinked


def test_the_anchors_follow_githubs_rule():
    assert _anchor("Time to plain DDP's quality on a slow link") == "time-to-plain-ddps-quality-on-a-slow-link"
    assert _anchor("Syncing every few steps at 500 and 100 Mbit/s") == "syncing-every-few-steps-at-500-and-100-mbits"
    assert _anchor("On a GPU: H100 and H200 passes") == "on-a-gpu-h100-and-h200-passes"
