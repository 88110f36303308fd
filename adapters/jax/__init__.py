"""JAX (with optax): its declaration (importing this module imports no framework); the adapter is
``adapters.jax.adapter``, built from the neutral builder (``adapters.jax.neutral``, its layers ``adapters.jax.layers``),
the training mechanics (``adapters.jax.training``) and the input (``adapters.jax.inputs``); JAX itself is imported
through ``adapters.jax.runtime``."""

from adapters import declaration as d
from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE

DECLARATION = d.Declaration(
    name="jax",
    title="JAX",
    adapter="adapters.jax.adapter:JaxAdapter",
    distributions=("jax", "jaxlib"),
    capabilities=d.Capabilities(
        precisions={"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA},
        notes={"fp16": FP16_NOTE},
        compile_modes={"compiled": "jax.jit of the whole train step (XLA)"},
        default_compile="compiled",
        layers=ALL_LAYERS,
        tasks=ALL_TASKS,
        # jax.nn.dot_product_attention's implementation=None is its XLA path on every device (einsum, softmax,
        # einsum; the cuDNN kernel only when asked for): the probabilities are kept
        attention="unfused",
        # input: loader. Grain (Google's loader for JAX; requirements/jax-*.txt): a grain.MapDataset whose element p
        # is step p's batch of the epoch's order, read ahead by grain.ReadOptions(num_threads) threads, and the
        # batches jax.device_put ahead of the step (adapters.jax.inputs: Inputs.open_loader, _device_prefetch); the
        # environment probe requires grain before a loader trial runs
        loader="grain.MapDataset",
        loader_modules={"grain": "grain"},
        # Adapter.gradient_norms: one jitted lax.scan over the micro-batches (adapters.jax.training), on one device
        gradient_noise=True,
        # a model of your own: a Flax module (adapters.jax.flax_model), trained by the same mechanics
        native_model="flax.linen.Module or flax.nnx.Module",
        limits=tuple(
            d.Limit(native=True, precision=precision, reason=(
                f"a Flax module computes in the dtype its layers are given (their dtype attribute, the module "
                f"author's choice), so the jax adapter cannot impose {precision} on a model of your own (the neutral "
                f"model's policy casts inside its own layers, adapters/jax/layers.py)"))
            for precision in ("bf16", "fp16")
        ) + (d.Limit(native=True, sync_batchnorm=True, reason=(
            "a Flax module's batchnorm is synchronised by its own axis_name (BatchNorm(axis_name=...)), which the jax "
            "adapter cannot set on a model of your own")),),
    ),
    data_parallel=d.DataParallelism(
        kind="devices",
        mechanism=("jax.shard_map over a jax.sharding.Mesh of the N devices (axis 'data'): parameters and optimizer "
                   "state replicated, the global batch sharded along it; the gradients' all-reduce is the psum of the "
                   "backward pass of the pmean'd loss (host devices on a CPU)"),
        # the CPU as N host devices; the worker appends it to XLA_FLAGS (never replaces them) before JAX is imported
        environment={"XLA_FLAGS": "--xla_force_host_platform_device_count={devices}"},
        sync_batchnorm=BOTH,
        sync_batchnorm_note=("lax.pmean of the batch moments over the devices (two all-reduces per batchnorm layer); "
                             "without it each device normalises its own shard and the running statistics are the "
                             "mean of the devices'"),
    ),
    environment=d.Environment(
        # JAX's GPU backend would otherwise map 75 % of the GPU's memory when it starts
        # (https://docs.jax.dev/en/latest/gpu_memory_allocation.html)
        variables={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        # a persistent compilation cache set outside the spec (its compilation_cache) changes the warm-up's time
        recorded=("JAX_COMPILATION_CACHE_DIR",),
    ),
    # on an H200 two run checks at one batch peaked at 13,097 MB (the worker that compiled and autotuned the step)
    # and 5,340 MB (the one that read it from the persistent cache): docs/design/max-batch.md
    memory=d.Memory(compile_peak=CUDA),
    start=d.Start(fork_safe=True),
)
