"""TensorFlow (Keras 3 layers): its declaration (importing this module imports no framework). The adapter is
``adapters.tensorflow.adapter``, built from the devices (``devices``: the device, the GPU memory options, the
MirroredStrategy), the neutral builder (``neutral``, over the layers of ``layers``), the training mechanics
(``training``, with the optimizer update and fp16's loss scaling of ``optimizer``) and the input (``inputs``)."""

from adapters import declaration as d
from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE

DECLARATION = d.Declaration(
    name="tensorflow",
    title="TensorFlow",
    adapter="adapters.tensorflow.adapter:TensorFlowAdapter",
    distributions=("tensorflow", "tensorflow-cpu", "keras"),
    capabilities=d.Capabilities(
        precisions={"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA},
        notes={"fp16": FP16_NOTE},
        compile_modes={"eager": "tf.function graphs without XLA", "compiled": "tf.function(jit_compile=True): XLA"},
        default_compile="eager",
        layers=ALL_LAYERS,
        tasks=ALL_TASKS,
        # Keras 3's TF dot_product_attention has no fused kernel (flash_attention raises): einsum, softmax, einsum, so
        # the probabilities are kept (and, causal, a bool (B, heads, L, L) mask for tf.where)
        attention="unfused",
        loader="tf.data.Dataset",
        gradient_noise=True,
        native_note=("a TensorFlow model of your own is a Keras model: give it to a keras-tensorflow entry ({name: "
                     "keras, backend: tensorflow, model: ...})"),
        limits=(
            # data-parallel in the compiled mode each replica's forward and backward pass is an XLA-compiled function
            # (adapters.tensorflow.training, Training._replica_step)
            d.Limit(reason=("the tensorflow adapter has no sync batchnorm in the compiled mode: the all-reduce of the "
                            "batch statistics would lie inside the XLA-compiled forward pass of each replica, where "
                            "MirroredStrategy cannot all-reduce (use the eager mode, or per-device batchnorm)"),
                    data_parallel=True, sync_batchnorm=True, compile="compiled"),
        ),
    ),
    data_parallel=d.DataParallelism(
        kind="devices",
        mechanism=("tf.distribute.MirroredStrategy over N logical CPU devices "
                   "(tf.config.set_logical_device_configuration) or N GPUs; one process"),
        sync_batchnorm=BOTH,
        sync_batchnorm_note=("the moments all-reduced in the replica context (ReplicaContext.all_reduce), as Keras's "
                             "BatchNormalization(synchronized=True) does (the adapter's batchnorm is FusedBatchNormV3, "
                             "not Keras's); eager mode only (not inside the compiled mode's per-replica XLA "
                             "function)"),
    ),
    environment=d.Environment(
        variables={"TF_CPP_MIN_LOG_LEVEL": "2"},  # silences TF's C++ INFO and WARNING logs
        threads={"TF_NUM_INTRAOP_THREADS": "{threads}", "TF_NUM_INTEROP_THREADS": "1"},
        allocator_options=("tensorflow_memory_growth",),
        recorded=("TF_FORCE_GPU_ALLOW_GROWTH",),
    ),
    # read when TF creates its CPU device: see harness.execution.limits
    memory=d.Memory(cpu_allocator_cap={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "{mib}"},
                    cpu_allocator="cpu BFC allocator"),
    start=d.Start(fork_safe=True),
)
