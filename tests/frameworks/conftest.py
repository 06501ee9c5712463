"""The full framework matrix runs only when asked for: `pytest -m frameworks_full tests/frameworks` runs the cells
outside the CI subset, `TRAINACCEL_FRAMEWORKS_FULL=1 pytest tests/frameworks` every cell."""

import os

import pytest

FULL = "frameworks_full"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each cell starts two workers that import a framework: the whole matrix takes minutes, CI keeps a subset.
    if FULL in (config.getoption("markexpr") or "") or os.environ.get("TRAINACCEL_FRAMEWORKS_FULL") == "1":
        return
    kept = [item for item in items if item.get_closest_marker(FULL) is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(FULL) is not None])
        items[:] = kept
