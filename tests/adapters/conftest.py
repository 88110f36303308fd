"""Fixtures shared by the adapter tests of the development environment."""

from __future__ import annotations

import numpy as np
import pytest

from tests.adapters import scenarios


def _pytorch_scenarios(tmp_path_factory: pytest.TempPathFactory):
    """The folder holding ``scenarios.run`` (layers.npz) and ``scenarios.run_blocks`` (blocks.npz) of PyTorch, made
    once for every xdist worker of the pytest command (``tests.helpers.made_once``)."""
    from tests.helpers import made_once

    def make(folder) -> None:
        from adapters.pytorch.adapter import PyTorchAdapter

        np.savez(folder / "layers.npz", **scenarios.run(PyTorchAdapter))
        np.savez(folder / "blocks.npz", **scenarios.run_blocks(PyTorchAdapter))
    return made_once(tmp_path_factory, "pytorch-scenarios", make)


def _load(path) -> dict[str, np.ndarray]:
    with np.load(path) as loaded:
        return dict(loaded)


@pytest.fixture(scope="session")
def pytorch_runs(tmp_path_factory) -> dict[str, np.ndarray]:
    """``scenarios.run`` of PyTorch, the reference the frameworks of other environments (JAX, Keras) are compared
    with."""
    return _load(_pytorch_scenarios(tmp_path_factory) / "layers.npz")


@pytest.fixture(scope="session")
def pytorch_block_runs(tmp_path_factory) -> dict[str, np.ndarray]:
    """``scenarios.run_blocks`` of PyTorch, the reference every other framework's block runs are compared with."""
    return _load(_pytorch_scenarios(tmp_path_factory) / "blocks.npz")
