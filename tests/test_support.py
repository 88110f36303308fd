"""What each adapter builds is declared, and a trial whose model needs more is ``unsupported`` before training: at
plan time for the built-in adapters (no framework imported), in the worker for the others."""

from __future__ import annotations

import ast

import adapters
from adapters import base
from harness.neutral import models
from harness.plan import checked_spec, unsupported_reason
from harness.results import report, store
from harness.spec import ModelSpec
from harness.studies import sweep
from tests.conftest import ROOT, TINY_CNN, base_spec
from tests.fault_adapter import FaultAdapter

RESIDUAL_CNN = [
    {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
    {"type": "residual", "activation": "relu", "body": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"}, {"type": "relu"}]},
    {"type": "flatten"},
    {"type": "dense", "units": 10},
]


def declarations(target: str) -> dict[str, object]:
    """The support attributes an adapter class declares (SUPPORTED_LAYERS, SUPPORTED_TASKS, PRECISIONS,
    COMPILE_MODES, DEFAULT_COMPILE, ATTENTION), read from its module's source (importing it would import its framework): each
    assignment's expression evaluated among adapters.base's names; one it does not declare has the base class's
    value."""
    module, _, cls = target.partition(":")
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    names = ("SUPPORTED_LAYERS", "SUPPORTED_TASKS", "PRECISIONS", "COMPILE_MODES", "DEFAULT_COMPILE",
             "ATTENTION")
    found = {name: getattr(base.Adapter, name) for name in names}
    for statement in node.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Name):
            name = statement.targets[0].id
            if name in names:
                found[name] = eval(compile(ast.Expression(statement.value), module, "eval"), vars(base))
    return found


def declared(target: str) -> tuple[frozenset[str], frozenset[str]]:
    """The SUPPORTED_LAYERS and SUPPORTED_TASKS an adapter class declares (``declarations``)."""
    found = declarations(target)
    return found["SUPPORTED_LAYERS"], found["SUPPORTED_TASKS"]


def test_the_registry_table_equals_what_each_adapter_declares():
    assert set(adapters.BUILTIN_SUPPORT) == set(adapters.BUILTIN)
    for name, target in adapters.BUILTIN.items():
        assert declared(target) == adapters.BUILTIN_SUPPORT[name], name
    # every built-in adapter builds every layer and task (each proven equal to PyTorch in tests/adapters/)
    everything = (base.ALL_LAYERS, base.ALL_TASKS)
    assert all(support == everything for support in adapters.BUILTIN_SUPPORT.values())


def test_the_execution_table_equals_what_each_adapter_declares():
    """adapters.BUILTIN_EXECUTION (what the plan decides from) against each class's PRECISIONS, COMPILE_MODES and
    DEFAULT_COMPILE; every adapter trains in fp32 on both device kinds and has its default among its modes."""
    assert set(adapters.BUILTIN_EXECUTION) == set(adapters.BUILTIN)
    for name, target in adapters.BUILTIN.items():
        found = declarations(target)
        precisions, modes, default = adapters.BUILTIN_EXECUTION[name]
        assert found["PRECISIONS"] == precisions, name
        assert frozenset(found["COMPILE_MODES"]) == modes and found["DEFAULT_COMPILE"] == default, name
        assert precisions["fp32"] == base.BOTH and default in modes, name


def test_the_attention_table_equals_what_each_adapter_declares(monkeypatch):
    """adapters.BUILTIN_ATTENTION (what the max-batch search predicts memory with) against each class's ATTENTION,
    one of the implementations the memory model knows; an adapter of HARNESS_ADAPTERS gets the contract's default."""
    from harness.neutral import memory

    assert set(adapters.BUILTIN_ATTENTION) == set(adapters.BUILTIN)
    for name, target in adapters.BUILTIN.items():
        assert declarations(target)["ATTENTION"] == adapters.BUILTIN_ATTENTION[name] == adapters.attention(name), name
        assert adapters.BUILTIN_ATTENTION[name] in memory.ATTENTIONS, name
    assert base.Adapter.ATTENTION in memory.ATTENTIONS
    monkeypatch.setenv("HARNESS_ADAPTERS", "pytorch=tests.fault_adapter:FaultAdapter")
    assert adapters.attention("pytorch") == adapters.attention("other") == base.Adapter.ATTENTION


def _before_blocks(monkeypatch, *names: str) -> None:
    """The registry table as it was before TensorFlow and MXNet built blocks: for ``names``, the basic layers and
    image classification only (a built-in adapter that lacks something, decided at plan time)."""
    for name in names:
        monkeypatch.setitem(adapters.BUILTIN_SUPPORT, name, (base.BASIC_LAYERS, base.IMAGE_TASKS))


def test_reasons_name_the_first_missing_kind_option_or_task(monkeypatch):
    _before_blocks(monkeypatch, "mxnet", "tensorflow")
    cnn = models.analyze(ModelSpec.model_validate({"layers": TINY_CNN}), (8, 8, 1), 10)
    assert adapters.unsupported("pytorch", cnn) is None and adapters.unsupported("mxnet", cnn) is None
    residual = models.analyze(ModelSpec.model_validate({"layers": RESIDUAL_CNN}), (8, 8, 1), 10)
    assert adapters.unsupported("mxnet", residual) == ("the mxnet adapter does not support residual blocks "
                                                       "(model.layers.1)")
    strided = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 2, "kernel_size": 3, "stride": 2}, {"type": "flatten"},
        {"type": "dense", "units": 10}]}), (8, 8, 1), 10)
    assert adapters.unsupported("tensorflow", strided) == ("the tensorflow adapter does not support conv2d with "
                                                           "stride > 1 (model.layers.0)")
    tokens = models.analyze(ModelSpec.model_validate({"layers": [
        {"type": "embedding", "vocab": 5, "dim": 4}, {"type": "sequence_pool"}, {"type": "dense", "units": 2}]}),
        models.Input.tokens(6, 5), 2)
    assert adapters.unsupported("tensorflow", tokens) == ("the tensorflow adapter does not support token inputs "
                                                          "(sequence classification) (the dataset)")
    # an adapter the registry has no table for is decided by its worker; so is a built-in name it replaces
    monkeypatch.setenv("HARNESS_ADAPTERS", "mxnet=tests.fault_adapter:FaultAdapter")
    assert adapters.unsupported("mxnet", residual) is None and adapters.unsupported("other", residual) is None
    # the contract's default: an adapter that declares nothing builds what every adapter built before blocks
    assert FaultAdapter().unsupported(cnn) is None
    assert FaultAdapter().unsupported(residual) == "the fault adapter does not support residual blocks " \
                                                   "(model.layers.1)"


def test_the_sweep_records_unsupported_trials_from_the_plan_and_from_the_worker(fault_adapter, monkeypatch,
                                                                                  tmp_path):
    monkeypatch.setattr(sweep, "probe_entries", lambda spec, file, device="cpu": [])  # no framework's interpreter is started
    _before_blocks(monkeypatch, "mxnet")
    spec = checked_spec(base_spec(model={"layers": RESIDUAL_CNN}, frameworks=["mxnet", fault_adapter],
                                  batch_sizes=[16, 32]), tmp_path / "s.yaml")
    assert unsupported_reason(spec, "mxnet") is not None and unsupported_reason(spec, fault_adapter) is None
    run_dir = sweep.run_spec(spec, tmp_path / "results")
    records = {(r["framework"], r["batch_size"]): r for r in store.read_trials(run_dir)}
    assert {key: r["status"] for key, r in records.items()} == {
        ("mxnet", 16): "unsupported", ("fault", 16): "unsupported",
        ("mxnet", 32): "unsupported", ("fault", 32): "unsupported"}
    planned = records[("mxnet", 16)]
    assert planned["reason"] == "not run: the mxnet adapter does not support residual blocks (model.layers.1)"
    assert planned["wall_seconds"] == 0.0 and not (run_dir / "events" / "mxnet-bs16-r0.jsonl").exists()
    worker = records[("fault", 16)]  # the worker decided, after prepare and before build
    assert worker["reason"] == "the fault adapter does not support residual blocks (model.layers.1)"
    events = [e["event"] for e in store.read_lines(run_dir / "events" / "fault-bs16-r0.jsonl")]
    assert events == ["start", "error"]
    text = report.write(run_dir).read_text()
    assert "| unsupported | unsupported |" in text
