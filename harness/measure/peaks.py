"""Peak dense floating-point throughput per GPU model and precision, for model-FLOPs utilization (MFU).

MFU = achieved training FLOP/s (model FLOPs per sample x samples per second; see harness.neutral.models) / the device's
peak for the precision used. Each entry gives its source: the vendor's datasheet or architecture whitepaper figure
without sparsity, at boost clock. A device is found by its exact NVML name (``normalise``d), never by a part of it:
"NVIDIA L40S" is not an L4 and "NVIDIA RTX A1000" not an A100. A device not in the table gets no MFU (``unknown_device``
says so in the record), never a guess, nor does a precision its entry lacks. A mixed-precision trial (bf16, fp16) is
measured against the low precision's Tensor Core peak, where its matrix work runs; tf32 against TF32's.

Names rather than PCI device ids: the name is what the sampler records for every trial (``sampler.name``), so a
stored run can be re-evaluated, and each name below is the whole NVML product name of one board, which names the
variants that differ in peak (SXM, PCIe, NVL). The names as ``nvidia-smi --query-gpu=name`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device model, by precision ("fp32", "tf32", "bf16", "fp16"), where the numbers come from,
    and the exact NVML names (``nvmlDeviceGetName``) of the boards it covers."""

    names: tuple[str, ...]
    flops: dict[str, float]
    source: str


T = 1e12

# Each board's NVML name in exactly one entry (``lookup`` compares whole normalised names).
PEAKS: tuple[Peak, ...] = (
    Peak(("NVIDIA H200",), {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},
         "NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, TF32 989 / BF16 1,979 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak(("NVIDIA H100 PCIe",), {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T},
         "NVIDIA H100 Tensor Core GPU datasheet (PCIe): FP32 51 TFLOPS, TF32 756 / BF16 1,513 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak(("NVIDIA H100 NVL",), {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T},
         "NVIDIA H100 Tensor Core GPU datasheet (NVL): FP32 60 TFLOPS, TF32 835 / BF16 1,671 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak(("NVIDIA H100 80GB HBM3",), {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},
         "NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, TF32 989 / BF16 1,979 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak(("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"),
         {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
         "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOPS, TF32 156 TFLOPS, BF16 and FP16 312 TFLOPS "
         "(dense)"),
    Peak(("NVIDIA L4",), {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T},
         "NVIDIA L4 datasheet: FP32 30.3 TFLOPS, TF32 120 / BF16 242 / FP16 242 TFLOPS with sparsity"),
    Peak(("NVIDIA A10",), {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},
         "NVIDIA A10 datasheet: FP32 31.2 TFLOPS, TF32 62.5 TFLOPS, BF16 and FP16 125 TFLOPS (dense)"),
    Peak(("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"), {"fp32": 14 * T, "fp16": 112 * T},
         "NVIDIA V100 Tensor Core GPU datasheet (PCIe): FP32 14 TFLOPS, Tensor Performance (FP16) 112 TFLOPS"),
    Peak(("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"), {"fp32": 15.7 * T, "fp16": 125 * T},
         "NVIDIA V100 Tensor Core GPU datasheet (SXM2): FP32 15.7 TFLOPS, Tensor Performance (FP16) 125 TFLOPS"),
    Peak(("Tesla T4",), {"fp32": 8.1 * T, "fp16": 65 * T},
         "NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed precision (FP16/FP32) 65 TFLOPS"),
    Peak(("NVIDIA GeForce RTX 4090",), {"fp32": 82.6 * T},
         "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: FP32 82.6 TFLOPS"),
    Peak(("NVIDIA GeForce RTX 3090",), {"fp32": 35.6 * T},
         "NVIDIA Ampere GA102 architecture whitepaper, GeForce RTX 3090: FP32 35.6 TFLOPS"),
    Peak(("NVIDIA GeForce GTX 1060 6GB",), {"fp32": 4.4 * T},
         "NVIDIA GeForce GTX 1060 (6 GB) specifications: 1280 CUDA cores x 1708 MHz boost x 2 = 4.4 TFLOPS FP32"),
)


def normalise(device_name: str) -> str:
    """An NVML name as ``lookup`` compares it: case-folded, runs of whitespace made one space, and a leading "NVIDIA "
    dropped (older drivers, e.g. 430, name GeForce boards without it: "GeForce GTX 1060 6GB")."""
    name = " ".join(device_name.split()).casefold()
    return name[len("nvidia "):] if name.startswith("nvidia ") else name


_BY_NAME: dict[str, Peak] = {normalise(name): peak for peak in PEAKS for name in peak.names}


def find(device_name: str | None) -> Peak | None:
    """The entry whose names include ``device_name`` (``normalise``d on both sides), or None."""
    return _BY_NAME.get(normalise(device_name)) if device_name else None


def lookup(device_name: str | None, precision: str = "fp32") -> tuple[float, str] | None:
    """(peak FLOP/s, source) for an NVML device name such as "NVIDIA H100 80GB HBM3" in ``precision``, or None for a
    device not in the table (matched exactly, ``find``) or a precision its entry lacks."""
    peak = find(device_name)
    if peak is None or precision not in peak.flops:
        return None
    return peak.flops[precision], peak.source


def missing(device_name: str | None, precision: str = "fp32") -> str | None:
    """Why ``lookup`` gives no peak, in words for a record and the report: "unknown device: no peak (NVIDIA L40S)",
    "no bf16 peak for Tesla T4", "unknown device: no peak (no device name)"; None when it gives one."""
    peak = find(device_name)
    if peak is None:
        return f"unknown device: no peak ({device_name or 'no device name'})"
    return None if precision in peak.flops else f"no {precision} peak for {device_name}"
