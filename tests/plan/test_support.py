"""What each adapter builds is declared, and a trial whose model needs more is ``unsupported`` before training,
decided in one place (``harness.plan.support``) from the declaration: at plan time for the built-in adapters (no
framework imported), in the worker, by the same rule, for an adapter of HARNESS_ADAPTERS."""

from __future__ import annotations

import dataclasses

import pytest

import adapters
from adapters.declaration import (
    ALL_LAYERS,
    ALL_TASKS,
    BASIC_LAYERS,
    BOTH,
    CPU,
    IMAGE_TASKS,
    DataParallelism,
    Limit,
    Memory,
)
from harness.neutral import models
from harness.plan import checked_spec, unsupported_reason
from harness.plan.support import Conditions, unsupported
from harness.results import store
from harness.spec import ModelSpec
from harness.studies import sweep
from tests.fakes.fault_adapter import FaultAdapter
from tests.helpers import TINY_CNN, base_spec, report_text, skip_probes

RESIDUAL_CNN = [
    {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
    {"type": "residual", "activation": "relu", "body": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"}, {"type": "relu"}]},
    {"type": "flatten"},
    {"type": "dense", "units": 10},
]


def test_every_declaration_is_complete_and_its_adapter_class_takes_it():
    """Each registry declaration names its framework, title, distributions and a module:Class path inside its own
    package; every adapter trains in fp32 on both device kinds, declares its default mode among its modes, every
    layer and task (each proven equal to PyTorch in tests/adapters/) and an attention the memory model knows. The
    class a path names takes its class-level facts from that declaration (checked where the framework is installed:
    tests/adapters, and JAX's in its own environment by tests/adapters/jax_suite.py)."""
    from harness.neutral import memory

    assert list(adapters.BUILTIN) == ["pytorch", "tensorflow", "mxnet", "jax", "keras-jax", "keras-torch",
                                      "keras-tensorflow"]
    for name, declared in adapters.BUILTIN.items():
        can, family = declared.capabilities, declared.family
        assert declared.name == name and declared.title and declared.distributions, name
        package = family.name or name
        assert declared.adapter.startswith(f"adapters.{package}.adapter:"), declared.adapter
        assert not family.native or (adapters.BUILTIN[family.native].title in declared.title), name
        assert can.precisions["fp32"] == BOTH and can.default_compile in can.compile_modes, name
        assert (can.layers, can.tasks) == (ALL_LAYERS, ALL_TASKS), name
        assert can.attention in memory.ATTENTIONS and can.attention == adapters.attention(name), name
        assert set(can.notes) <= set(can.precisions) | {"bf16", "tf32"}, name


def test_a_family_names_its_backends():
    """Keras's three declarations: keras-<backend>, each naming the native adapter of its framework, and found by
    ``with_backend`` (what ``{name: keras, backend: ...}`` resolves through)."""
    assert adapters.backends("keras") == ["jax", "torch", "tensorflow"] and adapters.backends("pytorch") == []
    assert [adapters.with_backend("keras", b) for b in ("jax", "torch", "tensorflow", "mxnet")] == [
        "keras-jax", "keras-torch", "keras-tensorflow", None]
    assert {adapters.BUILTIN[f"keras-{b}"].family.native for b in ("jax", "torch", "tensorflow")} == {
        "jax", "pytorch", "tensorflow"}
    with pytest.raises(ValueError, match="family and backend go together"):
        dataclasses.replace(adapters.BUILTIN["keras-jax"], name="keras-torch")


def test_a_declaration_that_contradicts_itself_is_refused():
    declared = adapters.BUILTIN["mxnet"]
    for change, words in (
            (lambda: dataclasses.replace(declared.capabilities, default_compile="eager",
                                         compile_modes={"compiled": "x"}), "default mode"),
            (lambda: dataclasses.replace(declared, adapter="adapters.mxnet.adapter"), "not module:Class"),
            (lambda: Memory(cpu_allocator_cap={"X": "{mib}"}), "go together"),
            (lambda: DataParallelism(kind="ranks"), "is not '', 'devices' or 'processes'")):
        with pytest.raises(ValueError, match=words):
            change()


def test_an_adapter_class_takes_its_declaration():
    """A class that names a declaration has exactly its name and facts; a subclass keeps its parent's; its
    options resolve "default" to the declaration's mode."""
    mxnet = adapters.BUILTIN["mxnet"]
    declared = dataclasses.replace(mxnet, name="planted", capabilities=dataclasses.replace(
        mxnet.capabilities, precisions={"fp32": CPU}, notes={"fp16": "never"}))

    class Declared(FaultAdapter, declaration=declared):
        pass

    assert Declared.name == "planted" and Declared.declaration is declared and Declared().mode == "compiled"

    class Sub(Declared):
        pass

    assert Sub.declaration is declared and Sub.name == "planted"
    assert FaultAdapter.declaration.name == "fault" and FaultAdapter.declaration.capabilities.layers == BASIC_LAYERS
    assert FaultAdapter.declaration.adapter == "tests.fakes.fault_adapter:FaultAdapter"
    info = models.analyze(ModelSpec.model_validate({"layers": TINY_CNN}), (8, 8, 1), 10)
    assert unsupported(declared, info, Conditions("fp32", "default", "cuda:0")) == (
        "the planted adapter does not train in fp32 on cuda (only on cpu)")
    assert unsupported(declared, info, Conditions("fp16", "default", "cpu")).endswith(": never")


def test_an_adapter_of_harness_adapters_has_no_declaration_here(monkeypatch):
    monkeypatch.setenv("HARNESS_ADAPTERS", "pytorch=tests.fakes.fault_adapter:FaultAdapter")
    assert adapters.declaration("pytorch") is None and adapters.declaration("other") is None
    assert adapters.attention("pytorch") == adapters.attention("other") == "unfused"
    assert adapters.declaration("mxnet") is adapters.BUILTIN["mxnet"]


def test_a_declared_limit_refuses_its_combination_and_nothing_else():
    """A ``Limit`` of the declaration refuses exactly the trials that match every condition it gives, with its
    reason; sync batchnorm matters only for a model with batchnorm."""
    limit = Limit(reason="no sync batchnorm when compiled", data_parallel=True, sync_batchnorm=True,
                  compile="compiled")
    tensorflow = adapters.BUILTIN["tensorflow"]
    declared = dataclasses.replace(
        tensorflow, name="limited", capabilities=dataclasses.replace(tensorflow.capabilities, limits=(limit,)),
        data_parallel=dataclasses.replace(tensorflow.data_parallel, sync_batchnorm=BOTH))
    norm = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 2, "kernel_size": 3}, {"type": "batchnorm"}, {"type": "flatten"},
        {"type": "dense", "units": 10}]}), (8, 8, 1), 10)
    plain = models.analyze(ModelSpec.model_validate({"layers": TINY_CNN}), (8, 8, 1), 10)
    assert unsupported(declared, norm,
                       Conditions("fp32", "compiled", "cpu", 2, True)) == "no sync batchnorm when compiled"
    assert unsupported(declared, norm, Conditions("fp32", "eager", "cpu", 2, True)) is None
    assert unsupported(declared, norm, Conditions("fp32", "compiled", "cpu", 2, False)) is None
    assert unsupported(declared, norm, Conditions("fp32", "compiled", "cpu", 1, True)) is None
    assert unsupported(declared, plain, Conditions("fp32", "compiled", "cpu", 2, True)) is None


def _before_blocks(monkeypatch, *names: str) -> None:
    """The registry as it was before TensorFlow and MXNet built blocks: for ``names``, the basic layers and image
    classification only (a built-in adapter that lacks something, decided at plan time)."""
    for name in names:
        declared = adapters.BUILTIN[name]
        monkeypatch.setitem(adapters.BUILTIN, name, dataclasses.replace(declared, capabilities=dataclasses.replace(
            declared.capabilities, layers=BASIC_LAYERS, tasks=IMAGE_TASKS)))


def _unsupported(name: str, info) -> str | None:
    """The plan's answer for the adapter ``name`` (None for one of HARNESS_ADAPTERS, decided in its worker)."""
    declared = adapters.declaration(name)
    return None if declared is None else unsupported(declared, info)


def test_reasons_name_the_first_missing_kind_option_or_task(monkeypatch):
    _before_blocks(monkeypatch, "mxnet", "tensorflow")
    cnn = models.analyze(ModelSpec.model_validate({"layers": TINY_CNN}), (8, 8, 1), 10)
    assert _unsupported("pytorch", cnn) is None and _unsupported("mxnet", cnn) is None
    residual = models.analyze(ModelSpec.model_validate({"layers": RESIDUAL_CNN}), (8, 8, 1), 10)
    assert _unsupported("mxnet", residual) == ("the mxnet adapter does not support residual blocks "
                                                       "(model.layers.1)")
    strided = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "stride": 2}, {"type": "flatten"},
        {"type": "dense", "units": 10}]}), (8, 8, 1), 10)
    assert _unsupported("tensorflow", strided) == ("the tensorflow adapter does not support conv2d with "
                                                           "stride > 1 (model.layers.0)")
    tokens = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "embedding", "vocab": 5, "dim": 4}, {"type": "sequence_pool"}, {"type": "dense", "units": 2}]}),
        models.Input.tokens(6, 5), 2)
    assert _unsupported("tensorflow", tokens) == ("the tensorflow adapter does not support token inputs "
                                                          "(sequence classification) (the dataset)")
    # an adapter the registry has no table for is decided by its worker; so is a built-in name it replaces
    monkeypatch.setenv("HARNESS_ADAPTERS", "mxnet=tests.fakes.fault_adapter:FaultAdapter")
    assert _unsupported("mxnet", residual) is None and _unsupported("other", residual) is None
    # the declaration's defaults: an adapter that declares no layers builds what every adapter built before blocks
    assert unsupported(FaultAdapter.declaration, cnn) is None
    assert unsupported(FaultAdapter.declaration, residual) == ("the fault adapter does not support residual blocks "
                                                               "(model.layers.1)")


def test_the_sweep_records_unsupported_trials_from_the_plan_and_from_the_worker(fault_adapter, monkeypatch,
                                                                                  tmp_path):
    # no framework's interpreter is started
    skip_probes(monkeypatch)
    _before_blocks(monkeypatch, "mxnet")
    spec = checked_spec(base_spec(model={"layers": RESIDUAL_CNN}, frameworks=["mxnet", fault_adapter],
                                  batch_sizes=[16, 32]), tmp_path / "s.yaml")
    assert unsupported_reason(spec, "mxnet") is not None and unsupported_reason(spec, fault_adapter) is None
    run_dir = sweep.run_spec(spec, tmp_path / "results")
    records = {(r.framework, r.batch_size): r for r in store.read_trials(run_dir)}
    assert {key: r.status for key, r in records.items()} == {
        ("mxnet", 16): "unsupported", ("fault", 16): "unsupported",
        ("mxnet", 32): "unsupported", ("fault", 32): "unsupported"}
    planned = records[("mxnet", 16)]
    assert planned.reason == "not run: the mxnet adapter does not support residual blocks (model.layers.1)"
    assert planned.wall_s == 0.0 and not (run_dir / "events" / "mxnet-bs16-r0.jsonl").exists()
    worker = records[("fault", 16)]  # the worker decided by the same rule, before prepare
    assert worker.reason == "the fault adapter does not support residual blocks (model.layers.1)"
    events = [(e.event, getattr(e, "name", None)) for e in store.read_events(run_dir, "fault-bs16-r0")]
    assert events == [("start", None), ("phase", "import"), ("error", None)]  # nothing prepared, nothing trained
    text = report_text(run_dir)
    assert "| unsupported | unsupported |" in text


def test_keras_on_jax_takes_no_memory_cap_on_a_gpu():
    """Keras's JAX backend cannot cap GPU memory (XLA's fraction is read when JAX's GPU backend starts, which Keras's
    device query does first): the declaration's limit refuses a capped trial on a GPU, and only that."""
    info = models.analyze(ModelSpec.model_validate({"layers": TINY_CNN}), (8, 8, 1), 10)
    declared = adapters.BUILTIN["keras-jax"]
    why = unsupported(declared, info, Conditions("fp32", "default", "cuda:0", memory_limit=True))
    assert why is not None and why.startswith("the keras-jax adapter takes no memory cap on a GPU"), why
    assert unsupported(declared, info, Conditions("fp32", "default", "cuda:0")) is None
    assert unsupported(declared, info, Conditions("fp32", "default", "cpu", memory_limit=True)) is None
    assert unsupported(adapters.BUILTIN["jax"], info,
                       Conditions("fp32", "default", "cuda:0", memory_limit=True)) is None
