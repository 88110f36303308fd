"""Device strings as specs, plans and adapters write them: ``cpu``, ``cuda`` and ``cuda:N`` (PyTorch's spelling,
https://pytorch.org/docs/stable/tensor_attributes.html#torch-device), and ``cpu:N`` for the logical CPU devices of a
data-parallel trial on the CPU."""

from __future__ import annotations


def device_kind(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a device string (``"cpu"``, ``"cpu:1"``, ``"cuda"``, ``"cuda:1"``)."""
    return device.partition(":")[0]


def device_index(device: str) -> int:
    """The device's index: ``"cuda:1"`` -> 1, ``"cpu:2"`` -> 2; ``"cuda"`` and ``"cpu"`` -> 0. Raises ValueError when
    what follows the colon is not a non-negative integer."""
    _, colon, index = device.partition(":")
    if colon and not index.isdigit():
        raise ValueError(f"{device!r}: the index after ':' must be a non-negative integer")
    return int(index or 0)


def is_gpu(device: str) -> bool:
    """Whether ``device`` names one GPU as ``cuda:N`` (the form a spec's ``device`` and ``devices`` take)."""
    kind, _, index = device.partition(":")
    return kind == "cuda" and index.isdigit()
