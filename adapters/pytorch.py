"""PyTorch adapter: eager mode, data resident on the device, NCHW.

Sync is ``torch.cuda.synchronize`` on a GPU (https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution);
on the CPU, PyTorch ops are synchronous. Allocator peaks come from ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` after ``reset_peak_memory_stats`` (https://pytorch.org/docs/stable/torch_cuda_memory.html).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adapters.base import Adapter, DeviceUnavailable


class PyTorchAdapter(Adapter):
    name = "pytorch"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._last_loss: torch.Tensor | None = None
        self._modules: dict[int, nn.Module] = {}

    def versions(self) -> dict[str, str]:
        out = {"torch": torch.__version__.split("+")[0], "torch_build": torch.__version__}
        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
        if torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
        return out

    def prepare(self, device: str, threads: int | None, seed: int) -> None:
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise DeviceUnavailable(f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build?)")
            index = int(device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise DeviceUnavailable(f"PyTorch sees {torch.cuda.device_count()} CUDA device(s); {device} is not one")
            torch.cuda.set_device(index)
            # fp32 means fp32: no TF32 in matmuls or convolutions (the other frameworks' defaults differ otherwise).
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.device = torch.device(device)
        if threads is not None:
            torch.set_num_threads(threads)
            if torch.get_num_interop_threads() != 1:
                # Allowed once per process, before any inter-op work; a worker process calls this first thing.
                torch.set_num_interop_threads(1)
        torch.manual_seed(seed)

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        layers: list[nn.Module] = []
        for layer in info.layers:
            spec = layer.spec
            module: nn.Module | None = None
            if layer.kind == "conv2d":
                module = nn.Conv2d(layer.input_shape[0], spec.filters, spec.kernel_size,
                                   padding=spec.kernel_size // 2 if spec.padding == "same" else 0)
            elif layer.kind == "dense":
                module = nn.Linear(layer.input_shape[0], spec.units)
            elif layer.kind == "maxpool2d":
                layers.append(nn.MaxPool2d(spec.pool_size, spec.stride or spec.pool_size))
            elif layer.kind == "flatten":
                layers.append(nn.Flatten())  # NCHW flattens channel-first: the canonical order
            elif layer.kind == "relu":
                layers.append(nn.ReLU())
            # softmax: folded into the cross-entropy loss
            if module is not None:
                with torch.no_grad():
                    module.weight.copy_(torch.from_numpy(weights[f"{layer.index}.weight"]))
                    module.bias.copy_(torch.from_numpy(weights[f"{layer.index}.bias"]))
                self._modules[layer.index] = module
                layers.append(module)
                if spec.activation == "relu":
                    layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers).to(self.device).train()
        params = self.net.parameters()
        if optimizer.name == "sgd":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(
                params, lr=optimizer.learning_rate, momentum=optimizer.momentum, weight_decay=optimizer.weight_decay)
        else:
            self.opt = torch.optim.Adam(params, lr=optimizer.learning_rate, betas=(optimizer.beta1, optimizer.beta2),
                                        eps=optimizer.epsilon, weight_decay=optimizer.weight_decay)

    def _to_device_images(self, images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).to(self.device)

    def load(self, data: Any) -> None:
        self.x_train = self._to_device_images(data.x_train)
        self.y_train = torch.from_numpy(data.y_train).to(self.device)
        self.x_test = self._to_device_images(data.x_test)
        self.y_test = torch.from_numpy(data.y_test).to(self.device)

    def train_step(self, indices: np.ndarray) -> None:
        idx = torch.from_numpy(indices).to(self.device, non_blocking=True)
        x = self.x_train.index_select(0, idx)
        y = self.y_train.index_select(0, idx)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        self.opt.step()
        self._last_loss = loss.detach()

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return float("nan") if self._last_loss is None else float(self._last_loss.item())

    @torch.no_grad()
    def evaluate(self, batch_size: int) -> tuple[float, float]:
        self.net.eval()
        total_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        n = self.x_test.shape[0]
        for start in range(0, n, batch_size):
            logits = self.net(self.x_test[start:start + batch_size])
            y = self.y_test[start:start + batch_size]
            total_loss += F.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(dim=1) == y).sum()
        self.net.train()
        return float(total_loss.item()) / n, float(correct.item()) / n

    @torch.no_grad()
    def predict(self, images: np.ndarray) -> np.ndarray:
        self.net.eval()
        logits = self.net(self._to_device_images(images.astype(np.float32)))
        self.net.train()
        return logits.cpu().numpy()

    def get_weights(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for index, module in self._modules.items():
            out[f"{index}.weight"] = module.weight.detach().cpu().numpy().copy()
            out[f"{index}.bias"] = module.bias.detach().cpu().numpy().copy()
        return out

    def reset_memory_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_stats(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}  # PyTorch keeps no allocator statistics for CPU tensors
        return {"allocator_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                "allocator_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(self.device))}

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"intra_op_threads": torch.get_num_threads(),
                               "inter_op_threads": torch.get_num_interop_threads()}
        if self.device.type == "cuda":
            out["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            out["allow_tf32"] = False
            out["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        return out

    def is_oom(self, exc: BaseException) -> bool:
        # torch.OutOfMemoryError (alias torch.cuda.OutOfMemoryError) is raised by the CUDA caching allocator. The CPU
        # allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), which has no type of
        # its own, so that one is recognised by its message.
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
