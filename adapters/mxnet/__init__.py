"""MXNet 1.9.1 (Gluon): its declaration (importing this module imports no framework); the adapter is
``adapters.mxnet.adapter``, its blocks ``adapters.mxnet.layers``, its AMP and optimizer ``adapters.mxnet.training``,
and ``adapters.mxnet.runtime`` imports MXNet itself (on numpy >= 1.24) for all three."""

from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE, Declaration

DECLARATION = Declaration(
    name="mxnet",
    title="MXNet",
    adapter="adapters.mxnet.adapter:MXNetAdapter",
    distributions=("mxnet",),
    precisions={"fp32": BOTH, "fp16": CUDA},
    compile_modes={"eager": "Gluon blocks run imperatively (not hybridized)",
                   "compiled": "hybridized: one cached symbolic graph (static_alloc, static_shape)"},
    default_compile="compiled",
    layers=ALL_LAYERS,
    tasks=ALL_TASKS,
    attention="unfused",  # batch_dot, softmax, batch_dot (adapters.mxnet.layers.SelfAttention)
    thread_environment={"MXNET_CPU_WORKER_NTHREADS": "1"},
    allocator_environment={"mxnet_gpu_mem_pool_type": "MXNET_GPU_MEM_POOL_TYPE"},
    notes={
        "fp16": FP16_NOTE,
        "bf16": "MXNet 1.9.1 has bfloat16 convolution and dense kernels only in oneDNN, which creates them on "
                "AVX-512 CPUs only (on AVX2: 'could not create a primitive descriptor iterator'), and no bfloat16 dot "
                "or batch_dot on the CPU ('dot only supports float32/float64 for CPU')",
        "tf32": "MXNet 1.9.1 has no TF32 switch; its fp32 on a GPU runs with NVIDIA_TF32_OVERRIDE=0",
    },
)
