"""Keras 3 on each of its backends: one declaration per backend (importing this module imports no framework). The
adapter is ``adapters.keras.adapter`` (one class, ``KerasAdapter``, a subclass per backend that names it) from the
parts of this package: the neutral builder (``neutral``, its own layers ``layers``), the training mechanics for any
``keras.Model`` (``training``, PyTorch's optimizer formulas ``optimizers``), the resident input (``inputs``) and
what differs per backend (``backends``), and the initial weights that a model of your own (any ``keras.Model``,
``KerasAdapter.native_model``) starts from on every backend, drawn once per seed (``weights``).

A spec selects one as ``{name: keras, backend: jax}`` (or by its name, ``keras-jax``); each runs in its own
environment (``harness envs create keras-jax``: requirements/keras-jax-cpu.txt), and the worker sets KERAS_BACKEND
before Keras is imported (``adapters.keras.adapter.import_keras``). Keras has no data loader mode and no data
parallelism here (the declarations say so; the plan refuses both).
"""

from adapters import declaration as d
from adapters.declaration import ALL_LAYERS, ALL_TASKS, BOTH, CUDA, FP16_NOTE

#: The dtype policy of each precision (https://keras.io/api/mixed_precision/policy/), Keras's global one: every
#: model built after ``prepare`` computes in it.
POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}

#: Why no backend trains in tf32 here.
TF32_NOTE = ("Keras 3 has no TF32 dtype policy (https://keras.io/api/mixed_precision/policy/); fp32 here turns each "
             "backend's TF32 off, and a TF32 comparison belongs to the native adapters")


def _keras(backend: str, title: str, native: str, distributions: tuple[str, ...], default: str,
           modes: dict[str, str], attention: str, environment: d.Environment | None = None,
           limits: tuple[d.Limit, ...] = ()) -> d.Declaration:
    return d.Declaration(
        name=f"keras-{backend}",
        title=f"Keras ({title})",
        adapter=f"adapters.keras.adapter:Keras{title}Adapter",
        distributions=("keras", *distributions),
        capabilities=d.Capabilities(
            # mixed_bfloat16 and mixed_float16 (loss scaling through the LossScaleOptimizer that Model.compile wraps
            # around the optimizer): https://keras.io/api/mixed_precision/policy/
            precisions={"fp32": BOTH, "bf16": BOTH, "fp16": CUDA},
            notes={"fp16": FP16_NOTE, "tf32": TF32_NOTE},
            compile_modes=modes,
            default_compile=default,
            layers=ALL_LAYERS,
            tasks=ALL_TASKS,
            attention=attention,
            # Adapter.gradient_norms: Model.stateless_call in training mode and the backend's own gradients
            # (adapters.keras.training, adapters.keras.backends), the moving statistics untouched
            gradient_noise=True,
            # a model of your own (adapters.keras.adapter.KerasAdapter.native_model), started on every backend from
            # the same initial weights, drawn once per seed on Keras's numpy backend (adapters.keras.weights)
            native_model="keras.Model",
            limits=limits,
        ),
        data_parallel=d.DataParallelism(
            mechanism=("not measured through Keras: keras.distribution.DataParallel exists for the JAX backend only; "
                         "the native adapters train data-parallel")),
        environment=environment or d.Environment(),
        family=d.Family(name="keras", backend=backend, native=native, shared_weights="adapters.keras.weights"),
    )


JAX = _keras(
    "jax", "JAX", "jax", ("jax", "jaxlib"), "compiled",
    {"eager": "Model.compile(jit_compile=False): the train step's jax ops dispatched one by one",
     "compiled": "Model.compile(jit_compile=True): jax.jit of Keras's train step (Keras's default on JAX)"},
    # keras.ops.dot_product_attention on JAX is jax.nn.dot_product_attention's XLA path: the probabilities are kept
    "unfused",
    # as the native JAX adapter: JAX's GPU backend would otherwise map 75 % of the GPU's memory when it starts
    environment=d.Environment(variables={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
    limits=(d.Limit(reason="the keras-jax adapter takes no memory cap on a GPU: XLA's memory fraction must be set "
                           "before JAX's GPU backend starts, and Keras's device query starts it (the native jax "
                           "adapter takes one)", device="cuda", memory_limit=True),),
)
TORCH = _keras(
    "torch", "PyTorch", "pytorch", ("torch",), "eager",
    {"eager": "Model.compile(jit_compile=False): eager torch ops (Keras's default on PyTorch)",
     "compiled": "Model.compile(jit_compile=True): torch.compile of Keras's train step"},
    # Keras 3.15's MultiHeadAttention(use_causal_mask=True) calls torch's scaled_dot_product_attention(is_causal=True)
    "fused",
)
TENSORFLOW = _keras(
    "tensorflow", "TensorFlow", "tensorflow", ("tensorflow", "tensorflow-cpu"), "eager",
    {"eager": "Model.compile(jit_compile=False): a tf.function graph without XLA (Keras's default on a CPU)",
     "compiled": "Model.compile(jit_compile=True): tf.function(jit_compile=True), XLA (Keras's default on a GPU)"},
    "unfused",
    environment=d.Environment(variables={"TF_CPP_MIN_LOG_LEVEL": "2"},
                              threads={"TF_NUM_INTRAOP_THREADS": "{threads}", "TF_NUM_INTEROP_THREADS": "1"}),
)

DECLARATIONS = (JAX, TORCH, TENSORFLOW)
