"""PyTorch adapter: eager mode, data resident on the device, NCHW.

Sync is ``torch.cuda.synchronize`` on a GPU (https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution);
on the CPU, PyTorch ops are synchronous. Allocator peaks come from ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` after ``reset_peak_memory_stats`` (https://pytorch.org/docs/stable/torch_cuda_memory.html). A
``memory_limit_bytes`` option caps the caching allocator on a GPU (``_apply_memory_limit``). The canonical batchnorm
is PyTorch's own (momentum convention and unbiased running variance), so ``nn.BatchNorm1d/2d`` need no adjustment.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adapters.base import Adapter, DeviceUnavailable, micro_batch_size
from harness.neutral.models import initial_buffers


class PyTorchAdapter(Adapter):
    name = "pytorch"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._last_loss: torch.Tensor | None = None
        self._modules: dict[int, nn.Module] = {}
        self._memory_limit: dict[str, Any] = {}  # what _apply_memory_limit applied, for settings()

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
            self._apply_memory_limit(index)
        self.device = torch.device(device)
        if threads is not None:
            torch.set_num_threads(threads)
            if torch.get_num_interop_threads() != 1:
                # Allowed once per process, before any inter-op work; a worker process calls this first thing.
                torch.set_num_interop_threads(1)
        torch.manual_seed(seed)

    def _apply_memory_limit(self, index: int) -> None:
        """``options["memory_limit_bytes"]`` on a GPU: ``torch.cuda.set_per_process_memory_fraction(limit /
        total_memory, index)`` (https://pytorch.org/docs/stable/generated/torch.cuda.set_per_process_memory_fraction
        .html). The caching allocator then raises ``torch.OutOfMemoryError`` for an allocation that would take the
        memory it holds from the device past the fraction x total memory (the CUDA context itself is not counted). A
        limit at or above the device's memory is a fraction of 1: no cap. On the CPU nothing is done here (the worker
        caps the process)."""
        limit = (self.options or {}).get("memory_limit_bytes")
        if not limit:
            return
        total = int(torch.cuda.get_device_properties(index).total_memory)
        fraction = min(float(limit) / total, 1.0)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        self._memory_limit = {"memory_limit_bytes": int(limit), "memory_fraction": fraction,
                              "device_total_memory_bytes": total}

    def build(self, info: Any, weights: dict[str, np.ndarray], optimizer: Any) -> None:
        """``nn.Sequential`` of the canonical layers (NCHW: weights copied in unchanged), in training mode except
        inside ``evaluate`` and ``predict``. Batchnorm's running statistics start from ``weights``' buffers if it has
        them, else from ``harness.neutral.models.initial_buffers``."""
        buffers = {**initial_buffers(info), **{k: v for k, v in weights.items() if k in info.buffer_names()}}
        layers: list[nn.Module] = []
        self._modules = {}
        for layer in info.layers:
            spec = layer.spec
            module: nn.Module | None = None
            if layer.kind == "conv2d":
                module = nn.Conv2d(layer.input_shape[0], spec.filters, spec.kernel_size,
                                   padding=spec.kernel_size // 2 if spec.padding == "same" else 0)
            elif layer.kind == "dense":
                module = nn.Linear(layer.input_shape[0], spec.units)
            elif layer.kind == "batchnorm":
                # momentum is PyTorch's own convention (the weight of the new batch), running_var is updated with the
                # unbiased batch variance: the canonical semantics, natively (harness.spec.BatchNorm).
                norm = nn.BatchNorm2d if len(layer.input_shape) == 3 else nn.BatchNorm1d
                module = norm(layer.input_shape[0], eps=spec.epsilon, momentum=spec.momentum)
                with torch.no_grad():
                    module.running_mean.copy_(torch.from_numpy(buffers[f"{layer.index}.running_mean"]))
                    module.running_var.copy_(torch.from_numpy(buffers[f"{layer.index}.running_var"]))
            elif layer.kind == "maxpool2d":
                layers.append(nn.MaxPool2d(spec.pool_size, spec.stride or spec.pool_size))
            elif layer.kind == "avgpool2d":
                layers.append(nn.AvgPool2d(spec.pool_size, spec.stride or spec.pool_size))  # no padding
            elif layer.kind == "global_avgpool2d":
                layers.extend([nn.AdaptiveAvgPool2d(1), nn.Flatten()])  # (N, C, 1, 1) -> (N, C)
            elif layer.kind == "dropout":
                layers.append(nn.Dropout(spec.rate))
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
                if getattr(spec, "activation", "none") == "relu":
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
        # torch.tensor always copies: from_numpy(...).to("cpu") would share the caller's array (for one channel the
        # NCHW transpose is already contiguous), and set_train_images would then write into the harness's dataset.
        return torch.tensor(images.transpose(0, 3, 1, 2), dtype=torch.float32, device=self.device)

    def load(self, data: Any) -> None:
        self.x_train = self._to_device_images(data.x_train)
        self.y_train = torch.from_numpy(data.y_train).to(self.device)
        self.x_test = self._to_device_images(data.x_test)
        self.y_test = torch.from_numpy(data.y_test).to(self.device)

    def set_train_images(self, images: np.ndarray) -> None:
        """Copies ``images`` (float32 NHWC) over the resident training images (NCHW) in place."""
        self.x_train.copy_(torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))))

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> None:
        """One optimizer step. With ``micro_batches`` k > 1, each of the k consecutive micro-batches is gathered,
        run forward and backward on its own with its mean loss scaled by 1 / k (``backward`` adds into ``.grad``), so
        that the one ``opt.step`` applies the mean gradient over all B samples while only one micro-batch's
        activations are alive at a time. The recorded loss is the mean over all B samples."""
        idx = torch.from_numpy(indices).to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        if micro_batches == 1:
            x = self.x_train.index_select(0, idx)
            y = self.y_train.index_select(0, idx)
            loss = F.cross_entropy(self.net(x), y)
            loss.backward()
            self.opt.step()
            self._last_loss = loss.detach()
            return
        micro_batch_size(len(indices), micro_batches)  # raises ValueError for an uneven split
        total = torch.zeros((), device=self.device)
        for part in idx.chunk(micro_batches):
            loss = F.cross_entropy(self.net(self.x_train.index_select(0, part)), self.y_train.index_select(0, part))
            loss = loss / micro_batches
            loss.backward()
            total += loss.detach()
        self.opt.step()
        self._last_loss = total

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

    def get_buffers(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for index, module in self._modules.items():
            if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                out[f"{index}.running_mean"] = module.running_mean.detach().cpu().numpy().copy()
                out[f"{index}.running_var"] = module.running_var.detach().cpu().numpy().copy()
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
            out["memory_limit_bytes"] = None
            out.update(self._memory_limit)
        return out

    def is_oom(self, exc: BaseException) -> bool:
        # torch.OutOfMemoryError (alias torch.cuda.OutOfMemoryError) is raised by the CUDA caching allocator. The CPU
        # allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), which has no type of
        # its own, so that one is recognised by its message.
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
