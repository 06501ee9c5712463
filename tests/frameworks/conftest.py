"""The full framework matrix runs only when asked for: `pytest -m frameworks_full tests/frameworks` runs the cells
outside the CI subset, `TRAINACCEL_FRAMEWORKS_FULL=1 pytest tests/frameworks` every cell."""

import pytest

from conftest import deselect_unless_asked

FULL = "frameworks_full"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each cell starts two workers that import a framework: the whole matrix takes minutes, CI keeps a subset.
    deselect_unless_asked(config, items, FULL, "TRAINACCEL_FRAMEWORKS_FULL")
