"""Peak dense floating-point throughput per GPU model and precision, for model-FLOPs utilization (MFU).

MFU = achieved training FLOP/s (model FLOPs per sample x samples per second; see harness.neutral.models) / the device's peak
for the precision used. Each entry gives its source: the vendor's datasheet or architecture whitepaper figure without
sparsity, at boost clock. A device not in the table gets no MFU (it is left empty, never guessed), nor does a precision
its entry lacks. A mixed-precision trial (bf16, fp16) is measured against the low precision's Tensor Core peak,
where its matrix work runs; tf32 against TF32's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device model, by precision ("fp32", "tf32", "bf16", "fp16"), and where the numbers come
    from."""

    pattern: str
    flops: dict[str, float]
    source: str


T = 1e12

# Matched in order against the NVML device name, case-insensitively, by substring: put specific names first.
PEAKS: tuple[Peak, ...] = (
    Peak("H200", {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},
         "NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, TF32 989 / BF16 1,979 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak("H100 PCIe", {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T},
         "NVIDIA H100 Tensor Core GPU datasheet (PCIe): FP32 51 TFLOPS, TF32 756 / BF16 1,513 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak("H100 NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T},
         "NVIDIA H100 Tensor Core GPU datasheet (NVL): FP32 60 TFLOPS, TF32 835 / BF16 1,671 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak("H100", {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T},
         "NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, TF32 989 / BF16 1,979 TFLOPS with sparsity; "
         "FP16 as BF16"),
    Peak("A100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
         "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOPS, TF32 156 TFLOPS, BF16 and FP16 312 TFLOPS "
         "(dense)"),
    Peak("L4", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T},
         "NVIDIA L4 datasheet: FP32 30.3 TFLOPS, TF32 120 / BF16 242 / FP16 242 TFLOPS with sparsity"),
    Peak("A10", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},
         "NVIDIA A10 datasheet: FP32 31.2 TFLOPS, TF32 62.5 TFLOPS, BF16 and FP16 125 TFLOPS (dense)"),
    Peak("V100-PCIE", {"fp32": 14 * T, "fp16": 112 * T},
         "NVIDIA V100 Tensor Core GPU datasheet (PCIe): FP32 14 TFLOPS, Tensor Performance (FP16) 112 TFLOPS"),
    Peak("V100", {"fp32": 15.7 * T, "fp16": 125 * T},
         "NVIDIA V100 Tensor Core GPU datasheet (SXM2): FP32 15.7 TFLOPS, Tensor Performance (FP16) 125 TFLOPS"),
    Peak("T4", {"fp32": 8.1 * T, "fp16": 65 * T},
         "NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed precision (FP16/FP32) 65 TFLOPS"),
    Peak("RTX 4090", {"fp32": 82.6 * T},
         "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: FP32 82.6 TFLOPS"),
    Peak("RTX 3090", {"fp32": 35.6 * T},
         "NVIDIA Ampere GA102 architecture whitepaper, GeForce RTX 3090: FP32 35.6 TFLOPS"),
    Peak("GTX 1060", {"fp32": 4.4 * T},
         "NVIDIA GeForce GTX 1060 (6 GB) specifications: 1280 CUDA cores x 1708 MHz boost x 2 = 4.4 TFLOPS FP32"),
)


def lookup(device_name: str | None, precision: str = "fp32") -> tuple[float, str] | None:
    """(peak FLOP/s, source) for an NVML device name such as "NVIDIA H100 80GB HBM3", or None when unknown."""
    if not device_name:
        return None
    name = device_name.lower()
    for peak in PEAKS:
        if peak.pattern.lower() in name and precision in peak.flops:
            return peak.flops[precision], peak.source
    return None
