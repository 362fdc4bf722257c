"""Shared test settings: deterministic seeds, float64 references."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
