"""The lost-replica cases outside the CI subset run only when asked for: `pytest -m resilience_full tests/resilience`,
or `TRAINACCEL_RESILIENCE_FULL=1 pytest tests/resilience` for every case."""

import os

import pytest

FULL = "resilience_full"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each case starts 3 emulated nodes: CI keeps a loss between syncs and the zero-code form.
    if FULL in (config.getoption("markexpr") or "") or os.environ.get("TRAINACCEL_RESILIENCE_FULL") == "1":
        return
    kept = [item for item in items if item.get_closest_marker(FULL) is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(FULL) is not None])
        items[:] = kept
