"""The lost-replica cases outside the CI subset run only when asked for: `pytest -m resilience_full tests/resilience`,
or `TRAINACCEL_RESILIENCE_FULL=1 pytest tests/resilience` for every case."""

import pytest

from conftest import deselect_unless_asked

FULL = "resilience_full"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each case starts 3 emulated nodes: CI keeps a loss and a rejoin, and the zero-code form.
    deselect_unless_asked(config, items, FULL, "TRAINACCEL_RESILIENCE_FULL")
