"""A stand-in ``pynvml`` module for subprocess tests of a "GPU machine": put this folder first on PYTHONPATH (with the
repository root after it) and ``import pynvml`` gets ``tests.fakes.nvml.fake_nvml``, which reports
``HARNESS_FAKE_NVML_COUNT`` GPUs (default one) named by ``HARNESS_FAKE_NVML_NAME`` (default "NVIDIA H100 80GB HBM3").
Only the NVML side is fake: the framework builds in the interpreters a test starts are real (CPU-only), as on a GPU
machine whose environments were made for the CPU."""

import os

from tests.fakes.nvml import fake_nvml, uuids

_fake = fake_nvml(name=os.environ.get("HARNESS_FAKE_NVML_NAME", "NVIDIA H100 80GB HBM3").encode(),
                  devices=uuids(int(os.environ.get("HARNESS_FAKE_NVML_COUNT", "1"))))
globals().update({k: v for k, v in vars(_fake).items() if not k.startswith("__")})
