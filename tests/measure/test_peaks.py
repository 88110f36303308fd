"""GPU peaks for MFU are found by the device's whole NVML name, never by a part of it."""

from __future__ import annotations

import pytest

from harness.measure import peaks

# The NVML names (nvidia-smi --query-gpu=name) the table must know, by entry (its first name).
EXPECTED_NAMES = {
    "NVIDIA H200": ["NVIDIA H200"],
    "NVIDIA H100 PCIe": ["NVIDIA H100 PCIe"],
    "NVIDIA H100 NVL": ["NVIDIA H100 NVL"],
    "NVIDIA H100 80GB HBM3": ["NVIDIA H100 80GB HBM3"],
    "NVIDIA A100-SXM4-80GB": ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB",
                              "NVIDIA A100 80GB PCIe"],
    "NVIDIA L4": ["NVIDIA L4"],
    "NVIDIA A10": ["NVIDIA A10"],
    "Tesla V100-PCIE-16GB": ["Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"],
    "Tesla V100-SXM2-16GB": ["Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"],
    "Tesla T4": ["Tesla T4"],
    "NVIDIA GeForce RTX 4090": ["NVIDIA GeForce RTX 4090"],
    "NVIDIA GeForce RTX 3090": ["NVIDIA GeForce RTX 3090"],
    "NVIDIA GeForce GTX 1060 6GB": ["NVIDIA GeForce GTX 1060 6GB"],
}


def test_the_table_has_each_entry_once_and_each_name_in_one_entry():
    assert {p.names[0]: list(p.names) for p in peaks.PEAKS} == EXPECTED_NAMES
    names = [peaks.normalise(n) for p in peaks.PEAKS for n in p.names]
    assert len(names) == len(set(names))
    assert all(p.flops.get("fp32") and p.source for p in peaks.PEAKS)


@pytest.mark.parametrize("entry", peaks.PEAKS, ids=lambda p: p.names[0])
def test_every_name_of_an_entry_finds_it_in_every_precision_it_has(entry):
    for name in entry.names:
        for spelled in (name, name.upper(), f"  {name.replace(' ', '  ')} ", name.removeprefix("NVIDIA ")):
            assert peaks.find(spelled) is entry, spelled
        for precision, flops in entry.flops.items():
            assert peaks.lookup(name, precision) == (flops, entry.source)
        for precision in {"fp32", "tf32", "bf16", "fp16"} - set(entry.flops):
            assert peaks.lookup(name, precision) is None
            assert peaks.missing(name, precision) == f"no {precision} peak for {name}"
        assert peaks.missing(name, "fp32") is None


@pytest.mark.parametrize("name", [
    "NVIDIA L40S", "NVIDIA L40", "NVIDIA RTX A1000", "NVIDIA A100X", "NVIDIA H100", "NVIDIA H100 SXM5 64GB",
    "NVIDIA H200 NVL", "NVIDIA A10G", "NVIDIA A100-SXM4", "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce GTX 1060 3GB", "NVIDIA GeForce GTX 1060", "Tesla V100S-PCIE-32GB", "NVIDIA T4", "A100", "H100",
    "NVIDIA", ""])
def test_near_misses_are_unknown(name):
    assert peaks.find(name) is None and peaks.lookup(name) is None
    assert peaks.missing(name) == f"unknown device: no peak ({name or 'no device name'})"


def test_no_name_is_unknown():
    assert peaks.lookup(None) is None and peaks.missing(None) == "unknown device: no peak (no device name)"
