"""Fixtures shared by the adapter tests of the development environment."""

from __future__ import annotations

import numpy as np
import pytest

from tests.adapters import scenarios


@pytest.fixture(scope="session")
def pytorch_block_runs() -> dict[str, np.ndarray]:
    """``scenarios.run_blocks`` of PyTorch, the reference every other framework's block runs are compared with
    (computed once for the session)."""
    from adapters.pytorch.adapter import PyTorchAdapter

    return scenarios.run_blocks(PyTorchAdapter)
