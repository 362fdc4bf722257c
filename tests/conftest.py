"""Shared test settings: deterministic seeds, float64 references."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def driver():  # noqa: ANN201 - a selenium WebDriver
    """Headless Chromium with the console and performance logs (tests/browser_util.py)."""
    from browser_util import start_chromium

    d = start_chromium(performance_log=True)
    yield d
    d.quit()
