"""MXNet 1.9.1 (Gluon): its declaration (importing this module imports no framework). The adapter is
``adapters.mxnet.adapter``; its neutral builder ``adapters.mxnet.neutral`` (with the blocks of
``adapters.mxnet.layers``), its training mechanics ``adapters.mxnet.training`` (with ``batchnorm``, ``optimizers`` and
``precision``), its input ``adapters.mxnet.inputs``; ``adapters.mxnet.runtime`` imports MXNet itself (on numpy >= 1.24)
for all of them."""

from adapters import declaration as d
from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE

DECLARATION = d.Declaration(
    name="mxnet",
    title="MXNet",
    adapter="adapters.mxnet.adapter:MXNetAdapter",
    distributions=("mxnet",),
    capabilities=d.Capabilities(
        precisions={"fp32": BOTH, "fp16": CUDA},
        notes={
            "fp16": FP16_NOTE,
            "bf16": "MXNet 1.9.1 has bfloat16 convolution and dense kernels only in oneDNN, which creates them on "
                    "AVX-512 CPUs only (on AVX2: 'could not create a primitive descriptor iterator'), and no bfloat16 "
                    "dot or batch_dot on the CPU ('dot only supports float32/float64 for CPU')",
            "tf32": "MXNet 1.9.1 has no TF32 switch; its fp32 on a GPU runs with NVIDIA_TF32_OVERRIDE=0",
        },
        compile_modes={"eager": "Gluon blocks run imperatively (not hybridized)",
                       "compiled": "hybridized: one cached symbolic graph (static_alloc, static_shape)"},
        default_compile="compiled",
        layers=ALL_LAYERS,
        tasks=ALL_TASKS,
        attention="unfused",  # batch_dot, softmax, batch_dot (adapters.mxnet.layers.SelfAttention)
        loader="mxnet.gluon.data.DataLoader",
        # Adapter.gradient_norms: a backward pass per micro-batch, the running statistics restored
        # (adapters.mxnet.training)
        gradient_noise=True,
        native_model="mxnet.gluon.HybridBlock",
        limits=(
            # PyTorch has nn.SyncBatchNorm.convert_sync_batchnorm; Gluon 1.9.1 has no counterpart, and the adapter
            # does not rebuild someone else's blocks (their names, momentum and axis are theirs).
            d.Limit(reason="the mxnet adapter cannot make a model of your own normalise over the global batch: Gluon "
                           "has no conversion to SyncBatchNorm and the harness does not swap the layers of your block; "
                           "a block built with mx.gluon.contrib.nn.SyncBatchNorm(num_devices=N) does so itself",
                    data_parallel=True, sync_batchnorm=True, native=True),
            # The docstring of mx.gluon.contrib.nn.SyncBatchNorm (mxnet/gluon/contrib/nn/basic_layers.py of 1.9.1):
            # "Current implementation of SyncBN does not support FP16 training."
            d.Limit(reason="the mxnet adapter has no synchronised batchnorm in fp16: MXNet 1.9.1's SyncBatchNorm "
                           "'does not support FP16 training'",
                    data_parallel=True, sync_batchnorm=True, precision="fp16"),
        ),
    ),
    data_parallel=d.DataParallelism(
        kind="devices",
        mechanism="Gluon over one context per device (mx.cpu(i) / mx.gpu(i)) with a gluon.Trainer on a 'device' "
                  "kvstore: the gradients are summed over the contexts (kvstore pushpull), then every context applies "
                  "the same update (update_on_kvstore=False)",
        sync_batchnorm=CUDA,
        sync_batchnorm_note="mx.gluon.contrib.nn.SyncBatchNorm, on GPUs only and in fp32 only ('does not support FP16 "
                            "training'): over CPU contexts MXNet 1.9.1's SyncBatchNorm deadlocks, because every CPU "
                            "context draws its temporary workspace from one shared pool (MXNET_CPU_TEMP_COPY, 4 by "
                            "default, in turn), and when two contexts' SyncBatchNorm operators (or one and an operator "
                            "that the other waits for) draw the same one, the engine runs them one after the other "
                            "while the first waits in the operator's barrier for the second (it hangs in the first "
                            "step)",
    ),
    environment=d.Environment(threads={"MXNET_CPU_WORKER_NTHREADS": "1"},
                              allocator={"mxnet_gpu_mem_pool_type": "MXNET_GPU_MEM_POOL_TYPE"}),
    start=d.Start(fork_safe=True),
)
