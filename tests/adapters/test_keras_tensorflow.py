"""Keras 3 on the tensorflow backend: the checks of tests/adapters/keras_checks.py, in envs/keras-tensorflow."""

import pytest

from tests.adapters.keras_checks import *  # noqa: F403 (the tests, collected here)


@pytest.fixture(scope="module")
def keras_name() -> str:
    return "keras-tensorflow"
