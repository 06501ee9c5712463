"""The README is a front page: what trainaccel is and gains, a script and the command, first; the two set-up
commands (the second is exactly what CI runs); its script is examples/train.py, which runs."""

import re
from pathlib import Path

import pytest

from conftest import run, trainaccel_cmd

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LINES = README.splitlines()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_the_readme_starts_with_the_two_set_up_commands_and_the_second_is_cis():
    first = _blocks("sh")[0].strip().splitlines()
    assert len(first) == 2 and first[0].endswith("trainaccel demo"), first
    ci = next(line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python3 -m venv"))
    assert first[1] == ci
    before = README[: README.index("```sh")]
    assert "```" not in before  # no other command comes first


def test_the_first_screen_holds_the_gain_its_plot_a_script_and_the_command():
    screen = "\n".join(LINES[:40])
    assert re.search(r"!\[[^\]]+\]\(docs/results/[\w.-]+\.png\)", screen), "the plot"
    assert "trainaccel run" in screen and "```python" in screen
    assert len(LINES) <= 150, len(LINES)
    for contributor in ("pytest -m", "marker", "TORCH_SPEC=", "tools/gpu-check", "2.7.1"):
        assert contributor not in README, contributor  # CONTRIBUTING.md's


def test_every_link_of_the_readme_is_there():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_the_readmes_script_is_examples_train_py():
    assert _blocks("python")[0] == (ROOT / "examples/train.py").read_text()


@pytest.mark.multiprocess
def test_the_example_trains_under_the_readmes_command(tmp_path):
    proc = run(
        [
            *trainaccel_cmd(),
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--sync-every",
            "auto",
            ROOT / "examples/train.py",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], proc.stdout
