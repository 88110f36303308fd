"""JAX (with optax): its declaration (importing this module imports no framework); the adapter is
``adapters.jax.adapter``, its layers ``adapters.jax.layers``."""

from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE, Declaration

DECLARATION = Declaration(
    name="jax",
    title="JAX",
    adapter="adapters.jax.adapter:JaxAdapter",
    distributions=("jax", "jaxlib"),
    precisions={"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA},
    compile_modes={"compiled": "jax.jit of the whole train step (XLA)"},
    default_compile="compiled",
    layers=ALL_LAYERS,
    tasks=ALL_TASKS,
    # jax.nn.dot_product_attention's implementation=None is its XLA path on every device (einsum, softmax, einsum;
    # the cuDNN kernel only when asked for): the probabilities are kept
    attention="unfused",
    # JAX's GPU backend would otherwise map 75 % of the GPU's memory when it starts
    # (https://docs.jax.dev/en/latest/gpu_memory_allocation.html)
    environment={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    notes={"fp16": FP16_NOTE},
)
