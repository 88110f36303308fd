"""PyTorch: its declaration (importing this module imports no framework); the adapter is ``adapters.pytorch.adapter``,
its blocks ``adapters.pytorch.layers``."""

from adapters import declaration as d
from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE

DECLARATION = d.Declaration(
    name="pytorch",
    title="PyTorch",
    adapter="adapters.pytorch.adapter:PyTorchAdapter",
    distributions=("torch",),
    capabilities=d.Capabilities(
        precisions={"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA},
        notes={"fp16": FP16_NOTE},
        compile_modes={"eager": "eager torch.nn modules",
                       "compiled": "torch.compile of the model (TorchInductor, mode 'default')"},
        default_compile="eager",
        layers=ALL_LAYERS,
        tasks=ALL_TASKS,
        # nn.MultiheadAttention(need_weights=False) in training calls scaled_dot_product_attention (causal:
        # is_causal, no mask), which picks a fused kernel keeping a log-sum-exp: flash on the CPU and for 16-bit CUDA
        # inputs, memory-efficient for float32 on CUDA (tests/test_flops.py measures the saved tensors).
        attention="fused",
        loader="torch.utils.data.DataLoader",
        gradient_noise=True,
        native_model="torch.nn.Module",
    ),
    # One process per device, launched as torchrun would (harness.execution.ranks); the adapter's _join and _ddp.
    data_parallel=d.DataParallelism(
        kind="processes",
        mechanism=("torch.nn.parallel.DistributedDataParallel, one process per device (gloo on the CPU, NCCL on CUDA "
                   "GPUs), gradients all-reduced in buckets during the backward pass"),
        sync_batchnorm=CUDA,
        sync_batchnorm_note=("torch.nn.SyncBatchNorm runs on GPUs only: on the CPU its forward raises \"SyncBatchNorm "
                             "expected input tensor to be on GPU\" (torch 2.13)"),
    ),
    # https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf
    environment=d.Environment(allocator={"pytorch_cuda_alloc_conf": "PYTORCH_CUDA_ALLOC_CONF"}),
    # torch.optim.Optimizer's constructor imports TorchDynamo (about 1.5 s on the project's CPU VM)
    start=d.Start(fork_safe=True, preload=("torch._dynamo",)),
)
