"""What a framework's adapter declares about itself, readable without importing the framework: its ``Declaration``.

Each ``adapters/<framework>/__init__.py`` holds one ``Declaration``; ``adapters/__init__.py`` collects them, and the
adapter class takes its class-level facts from it (``Adapter.__init_subclass__``), so the two cannot disagree. A
declaration is grouped by who reads it: ``Capabilities`` (what it trains: the plan's support rule),
``DataParallelism``, ``Environment`` (its workers' variables), ``Memory`` (what its memory figures mean), ``Start``
(how its workers start) and ``Family`` (Keras's backends), each documented where it is defined.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from harness.neutral.info import TASKS

#: The layer kinds every adapter built before blocks existed (and options of none of them): conv2d with stride 1,
#: "same" or "valid" padding and a bias, dense on flat inputs with relu or no activation, and the rest as they were.
BASIC_LAYERS = frozenset({"conv2d", "maxpool2d", "avgpool2d", "global_avgpool2d", "batchnorm", "dropout", "flatten",
                          "dense", "relu", "softmax"})
#: Image classification only: NHWC float32 images in, one label per sample.
IMAGE_TASKS = frozenset({"image_classification"})
#: Every layer kind and layer option of the neutral model (``harness.neutral.info.requirements``'s vocabulary).
ALL_LAYERS = BASIC_LAYERS | frozenset({
    "residual", "layernorm", "gelu", "embedding", "attention", "sequence_pool", "conv2d.stride", "conv2d.padding",
    "conv2d.no_bias", "dense.gelu", "dense.sequence", "attention.causal"})
#: Every task: images, sequence classification and next-token prediction.
ALL_TASKS = frozenset(TASKS)

#: Device kinds, for ``Capabilities.precisions``.
CPU, CUDA, BOTH = frozenset({"cpu"}), frozenset({"cuda"}), frozenset({"cpu", "cuda"})
#: What an adapter declares by default: fp32 on the CPU and on CUDA GPUs, one execution mode.
FP32_ONLY = MappingProxyType({"fp32": BOTH})
EAGER_ONLY = MappingProxyType({"eager": "the framework's usual execution"})

#: Why a built-in adapter does not train in fp16 on the CPU (quoted in the ``unsupported`` reason).
FP16_NOTE = ("fp16 with dynamic loss scaling is declared for CUDA GPUs only, by the harness's choice: the recipe "
             "exists for Tensor Cores, and a CPU run in fp16 answers no question this tool asks (README, precision)")


#: Environment variables that hold a list of flags: a declared value is appended to them, never replaces them.
FLAG_VARIABLES = frozenset({"XLA_FLAGS"})


def append_flags(current: str, added: str) -> str:
    """A flag variable's value (``XLA_FLAGS``) with the flags of ``added`` after those of ``current``.

    Only flags (``--name`` or ``--name=value``) are kept, whatever the order, and a flag given twice keeps its last
    value in its last place: XLA's parser (``xla/parse_flags_from_env.cc``) reads ``XLA_FLAGS`` as such tokens, and
    in jaxlib 0.10.2 a token without the dashes (``intra_op_parallelism_threads=1``) ended its parsing,
    so that every flag after it, the data-parallel host device count among them, was silently ignored.

    Args:
        current: the variable's value as it is (the launcher's or the user's flags; may be empty).
        added: the flags to append, space-separated.

    Returns:
        The flags, space-separated; empty when there are none.
    """
    flags: dict[str, str] = {}
    for token in f"{current} {added}".split():
        if token.startswith("--") and len(token) > 2:
            name = token.split("=", 1)[0]
            flags.pop(name, None)
            flags[name] = token
    return " ".join(flags.values())


@dataclass(frozen=True)
class Limit:
    """A combination of trial settings an adapter cannot train, with the reason the plan records
    (``Capabilities.limits``). Every condition given must hold for the limit to apply; None matches anything.
    data_parallel: the trial trains on several devices; sync_batchnorm: it asks for synchronised batchnorm and the
    model has batchnorm; compile: the resolved mode ("eager", "compiled"); precision; device: the device kind ("cpu",
    "cuda"); input: "resident" or "loader"; memory_limit: the trial has a memory cap (``memory_limit_mb``, or a
    max-batch probe's); native: the trial trains a model of your own (a framework entry's ``model``) rather than the
    neutral one."""

    reason: str
    data_parallel: bool | None = None
    sync_batchnorm: bool | None = None
    compile: str | None = None
    precision: str | None = None
    device: str | None = None
    input: str | None = None
    memory_limit: bool | None = None
    native: bool | None = None


@dataclass(frozen=True)
class Capabilities:
    """What the adapter trains, which the plan's support rule reads (``harness.plan.support``): a trial outside it is
    refused with the reason, before the framework is imported.

    precisions: precision ("fp32", "tf32", "bf16", "fp16") -> the device kinds ("cpu", "cuda") it trains in there.
    notes: precision -> why the adapter does not train in it where ``precisions`` alone would not say.
    compile_modes: mode ("eager", "compiled") -> what it means in this framework, in words; default_compile: the mode
    ``compile: default`` selects. layers, tasks: the layer kinds and options, and the tasks, it builds
    (``harness.neutral.info.requirements``'s vocabulary). attention: what its attention keeps for the backward pass
    ("unfused" or "fused", ``harness.neutral.memory.ATTENTIONS``).
    loader: the framework's own data loader that ``input: loader`` feeds each step through, in words
    ("torch.utils.data.DataLoader"); "" when the adapter has no loader mode. loader_modules: what ``input: loader``
    needs in the entry's environment beside the framework, module -> distribution (JAX's Grain): the environment
    probe requires them before a loader trial runs.
    gradient_noise: it implements ``Adapter.gradient_norms`` (the gradient noise scale's squared norms) on one
    device; the plan refuses a noise-scale trial of an adapter that does not, or of a data-parallel one.
    native_model: the framework's own model type it adopts from a factory (a model of your own,
    ``harness.spec.NativeModel``), in words ("torch.nn.Module"); "" when it adopts none, and ``native_note`` says
    what to use instead.
    limits: further combinations it cannot train (``Limit``), each with its reason.
    """

    precisions: Mapping[str, frozenset[str]] = field(default_factory=lambda: FP32_ONLY)
    notes: Mapping[str, str] = field(default_factory=dict)
    compile_modes: Mapping[str, str] = field(default_factory=lambda: EAGER_ONLY)
    default_compile: str = "eager"
    layers: frozenset[str] = BASIC_LAYERS
    tasks: frozenset[str] = IMAGE_TASKS
    attention: str = "unfused"
    loader: str = ""
    loader_modules: Mapping[str, str] = field(default_factory=dict)
    gradient_noise: bool = False
    native_model: str = ""
    native_note: str = ""
    limits: tuple[Limit, ...] = ()

    def __post_init__(self) -> None:
        _freeze(self, "precisions", "notes", "compile_modes", "loader_modules")
        if self.default_compile not in self.compile_modes:
            raise ValueError(f"default mode {self.default_compile!r} is not among its compile_modes")

    def mode(self, compile: str) -> str:
        """The mode ``compile`` selects: ``default_compile`` for "default", else ``compile`` itself."""
        return self.default_compile if compile == "default" else compile


@dataclass(frozen=True)
class DataParallelism:
    """How the adapter trains on several devices (the plan's ``harness.plan.support.data_parallel_gap``, the worker's
    start of a data-parallel trial).

    kind: "" (it does not), "devices" (one process drives them all) or "processes" (one process per device, ranks
    started by the worker as torchrun would). mechanism: the framework's mechanism in words
    ("tf.distribute.MirroredStrategy"), quoted in the record and, where ``kind`` is "", in the refusal.
    environment: worker variables a data-parallel trial sets, "{devices}" standing for N (JAX's host device count).
    sync_batchnorm: the device kinds ("cpu", "cuda") on which it can normalise batchnorm over the global batch (where
    it cannot, the reason is ``sync_batchnorm_note``).
    """

    kind: str = ""
    mechanism: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)
    sync_batchnorm: frozenset[str] = frozenset()
    sync_batchnorm_note: str = ""

    def __post_init__(self) -> None:
        _freeze(self, "environment")
        if self.kind not in ("", "devices", "processes"):
            raise ValueError(f"data_parallel {self.kind!r} is not '', 'devices' or 'processes'")

    def variables(self, devices: int, environ: Mapping[str, str]) -> dict[str, str]:
        """``environment`` for a trial on ``devices`` devices ("{devices}" = N), as the values to put in the
        environment before the framework is imported: a variable of ``FLAG_VARIABLES`` already set in ``environ`` (the
        launcher's own flags) keeps its value, the new flags appended (``append_flags``); any other is set."""
        out = {}
        for name, value in self.environment.items():
            value = value.replace("{devices}", str(devices))
            if name in FLAG_VARIABLES:
                value = append_flags(environ.get(name, ""), value)
            out[name] = value
        return out


@dataclass(frozen=True)
class Environment:
    """The worker's environment variables for the framework (``harness.execution.workers``), and those the run
    records (``harness.measure.machine``).

    variables: worker environment variables and their defaults (a value the launcher's environment sets wins).
    threads: variables set when a trial fixes the CPU thread count, "{threads}" standing for it.
    allocator: ``harness.spec.AllocatorSpec`` field -> the variable a set value goes to. allocator_options:
    ``AllocatorSpec`` fields the worker passes in ``Adapter.options.allocator`` (the others keep their defaults
    there). recorded: further variables of the launcher's environment that change this framework's numbers (recorded
    with the run).
    """

    variables: Mapping[str, str] = field(default_factory=dict)
    threads: Mapping[str, str] = field(default_factory=dict)
    allocator: Mapping[str, str] = field(default_factory=dict)
    allocator_options: tuple[str, ...] = ()
    recorded: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _freeze(self, "variables", "threads", "allocator")


@dataclass(frozen=True)
class Memory:
    """What the memory a worker reports means for this framework (``harness.execution.limits``, max-batch).

    cpu_allocator_cap: variables that cap the framework's CPU tensor allocator (read when it creates its CPU device),
    "{mib}" standing for the cap in MiB (2^20 bytes); empty: the worker's process limit alone
    (``harness.execution.limits``). cpu_allocator: that allocator's name in the limit's records ("cpu BFC
    allocator"). compile_peak: the device kinds ("cuda") on which the allocator peak a worker reports includes what
    compiling its steps borrowed (XLA's autotuner on a GPU tries algorithms in whatever memory the cap leaves free,
    and JAX cannot reset its peak after it); the adapter reads compiled steps from ``RunOptions.compilation_cache``.
    max-batch then has an uncounted worker compile each size's steps into that cache before the workers whose peaks
    it compares.
    """

    cpu_allocator_cap: Mapping[str, str] = field(default_factory=dict)
    cpu_allocator: str = ""
    compile_peak: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _freeze(self, "cpu_allocator_cap")
        if bool(self.cpu_allocator_cap) != bool(self.cpu_allocator):
            raise ValueError("cpu_allocator_cap and cpu_allocator go together")


@dataclass(frozen=True)
class Start:
    """How a worker of this framework may start (``harness.execution.forkserver``).

    fork_safe: a worker may be forked from a parent that has imported the adapter's module (and so the framework)
    and done nothing else: the framework starts no thread at import that a fork would leave behind, or re-creates
    them after fork itself; shown by tests/execution/test_forkserver.py. preload: modules the parent imports besides
    the adapter's, which every trial would import later (PyTorch imports ``torch._dynamo`` when its first optimizer
    is made).
    """

    fork_safe: bool = False
    preload: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """An adapter that runs one API on several frameworks (Keras 3: family "keras"); every field "" for the others.

    name: the family; a spec entry ``{name: <family>, backend: <backend>}`` selects the member on ``backend``
    ("jax", "torch", "tensorflow"). native: the built-in adapter of the framework it runs on ("jax"), for the
    report's "over native" ratios. shared_weights: for a family whose members must start a model of your own from the
    same initial weights on every backend, the module that draws them once per seed (run with ``python -m``,
    ``harness.execution.native_probe``); "" where each draws its own from the seed.
    """

    name: str = ""
    backend: str = ""
    native: str = ""
    shared_weights: str = ""


@dataclass(frozen=True)
class Declaration:
    """One framework's facts, for the plan, the launcher, the worker and the report, in named parts.

    name: the adapter's name in specs ("pytorch"). title: its name in reports ("PyTorch"). adapter: the class,
    "module:Class" (importing that module imports the framework). distributions: the installed distributions whose
    versions the run records (``harness.measure.machine``) and whose keys of ``Adapter.versions`` the report shows
    ("tensorflow-cpu" is the key "tensorflow_cpu"). capabilities: what it trains (``Capabilities``). data_parallel:
    how it trains on several devices (``DataParallelism``). environment: its workers' variables (``Environment``).
    memory: what its memory figures mean (``Memory``). start: how its workers start (``Start``). family: the family
    it belongs to (``Family``: Keras's backends).
    """

    name: str
    title: str
    adapter: str
    distributions: tuple[str, ...] = ()
    capabilities: Capabilities = field(default_factory=Capabilities)
    data_parallel: DataParallelism = field(default_factory=DataParallelism)
    environment: Environment = field(default_factory=Environment)
    memory: Memory = field(default_factory=Memory)
    start: Start = field(default_factory=Start)
    family: Family = field(default_factory=Family)

    def __post_init__(self) -> None:
        if ":" not in self.adapter:
            raise ValueError(f"{self.name}: adapter {self.adapter!r} is not module:Class")
        family = self.family
        if bool(family.name) != bool(family.backend) or (
                family.name and self.name != f"{family.name}-{family.backend}"):
            raise ValueError(f"{self.name}: family and backend go together, and the name is family-backend")

    @property
    def version_keys(self) -> tuple[str, ...]:
        """The keys of ``Adapter.versions`` that name this framework's distributions ("-" as "_")."""
        return tuple(d.replace("-", "_") for d in self.distributions)


def _freeze(part: object, *names: str) -> None:
    """The mapping fields ``names`` of the frozen dataclass ``part`` made read-only copies."""
    for name in names:
        object.__setattr__(part, name, MappingProxyType(dict(getattr(part, name))))
