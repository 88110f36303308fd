"""A model of your own (``harness.spec.NativeModel``): its factory imported and called, the task and output shape it
must have for the spec's dataset, and where initial weights shared by a family of adapters are kept.

Runs in the entry's worker and in the probe that checks the entry before anything runs
(``harness.execution.native_probe``); every failure is a ``NativeModelError`` naming the spec field it concerns, so
that the probe can print one line naming the file and field (docs/guide/own-model.md).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.neutral.info import Input
from harness.spec import NativeModel


class NativeModelError(ValueError):
    """A model of your own that cannot be used: ``field`` is the spec field below the framework entry it concerns
    (``model.factory``, ``model``, ``model.kwargs``, ``packages``); ``str(err)`` is one line saying why."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class NativeSource:
    """What an adapter needs to adopt a model of your own (``adapters.base.Adapter.native_model``): the factory (for
    messages), what the model is fed (``input``, NHWC images or token ids) and its classes (the vocabulary for a
    next-token task), the trial's seed (the framework's own initialisation follows it), and for a family that starts
    every backend from the same weights (``Family.shared_weights``) the weights file to load, else None."""

    factory: str
    input: Input
    classes: int
    seed: int
    initial_weights: Path | None = None


def load_factory(factory: str) -> Callable[..., Any]:
    """The callable ``factory`` names: ``"package.module:name"`` (imported), or ``"/path/file.py:name"`` (the file
    imported as the module of its stem, its folder first on ``sys.path``, as Python runs a script; the spec's relative
    path is made absolute when the spec is loaded), ``name`` may be dotted (``Class.method``). Raises NativeModelError
    (field ``model.factory``) when the module cannot be imported (with the import error's message), lacks the name,
    or the name is not callable."""
    module_name, _, attribute = factory.rpartition(":")
    try:
        if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise NativeModelError("model.factory", f"{factory}: no file {path}")
            folder = str(path.parent.resolve())
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module = importlib.import_module(path.stem)
        else:
            module = importlib.import_module(module_name)
    except NativeModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - an ImportError, or whatever the module raised while it was imported
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NativeModelError("model.factory", f"cannot import {module_name}: {type(exc).__name__}: {first}"
                               .rstrip(": ")) from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise NativeModelError("model.factory", f"{module_name} has no {attribute}")
        target = getattr(target, part)
    if not callable(target):
        raise NativeModelError("model.factory", f"{factory} is a {type(target).__name__}, not a callable")
    return target


def make(model: NativeModel, seed: int | None = None) -> Any:
    """``model``'s factory called with its kwargs, and with ``seed=seed`` (the trial's) when the factory takes a
    parameter named ``seed`` that the kwargs do not set: a framework whose models draw their weights when they are
    made, from a generator of their own (Flax nnx's ``nnx.Rngs``), gets the trial's seed that way; the others follow
    the framework's seed, set before the call. Raises NativeModelError: ``load_factory``'s, or (field ``model``) the
    factory's own exception in one line."""
    factory = load_factory(model.factory)
    kwargs = dict(model.kwargs)
    if seed is not None and "seed" not in kwargs and _takes_seed(factory):
        kwargs["seed"] = seed
    try:
        return factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's code: any exception is reported as one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NativeModelError("model", f"{model.factory}({_shown(model.kwargs)}) raised "
                                        f"{type(exc).__name__}: {first}".rstrip(": ")) from None


def _takes_seed(factory: Callable[..., Any]) -> bool:
    try:
        return "seed" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or a C extension's callable: no signature to read
        return False


def task(input: Input) -> str:
    """The task a model fed ``input`` trains for: ``image_classification``, ``sequence_classification`` or
    ``next_token`` (``harness.neutral.info.TASKS``), as the neutral model's ``ModelInfo.task`` says it."""
    if input.kind == "images":
        return "image_classification"
    return "next_token" if input.per_position else "sequence_classification"


def output_shape(input: Input, classes: int) -> tuple[int, ...]:
    """The per-sample logits a model for ``input`` must give: (classes,), or (length, vocabulary) for a next-token
    task (``classes`` is then the vocabulary)."""
    return (input.shape[0], classes) if task(input) == "next_token" else (classes,)


def check_output(shape: tuple[int, ...], input: Input, classes: int, factory: str) -> None:
    """Raises NativeModelError (field ``model``) unless ``shape``, a batch's logits (batch, ...), is what the task
    needs (``output_shape``), e.g. "torchvision.models:resnet18 gives (2, 1000) logits, the dataset needs (batch,
    10): 10 classes"."""
    wanted = output_shape(input, classes)
    if tuple(shape[1:]) != wanted:
        what = f"{classes} classes" if len(wanted) == 1 else f"{wanted[0]} positions of a {classes}-token vocabulary"
        raise NativeModelError("model", f"{factory} gives {tuple(shape)} logits, the dataset needs "
                                        f"(batch, {', '.join(map(str, wanted))}): {what}")


def output_logits(out: Any, array_type: type, returned: str, array_name: str) -> Any:
    """A model of your own's output as the logits: an ``array_type`` as it is, an output object's ``logits``
    attribute (transformers' ``ModelOutput``), or the first element of a tuple or list. Raises TypeError for anything
    else: "<returned> a <type>, not logits (<array_name>, or an output with logits)"."""
    if isinstance(out, array_type):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, array_type):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], array_type):
        return out[0]
    raise TypeError(f"{returned} a {type(out).__name__}, not logits ({array_name}, or an output with logits)")


def shared_weights_path(family: str, model: NativeModel, input: Input, classes: int, seed: int,
                        cache: Path) -> Path:
    """Where the initial weights of ``model`` for ``seed``, drawn once and loaded by every adapter of ``family``
    (Keras on each backend), are kept: a file under ``cache``/initial-weights named by a hash of everything that
    decides them (the family, the factory and its kwargs, the input and classes, the seed)."""
    key = json.dumps({"family": family, "factory": model.factory, "kwargs": model.kwargs,
                      "input": [input.kind, list(input.shape), input.vocab, input.per_position], "classes": classes,
                      "seed": seed}, sort_keys=True, default=str)
    return cache / "initial-weights" / f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def draw_shared_weights(module: str, model: NativeModel, input: Input, classes: int, seed: int, path: Path,
                        python: str | None = None, timeout_s: float = 600.0) -> Path:
    """The initial weights of ``model`` for ``seed`` at ``path`` (``shared_weights_path``), drawn now by ``python -m
    module`` (the family's drawing module, ``Family.shared_weights``; default interpreter: this one) unless the
    file exists. The module reads one JSON argument (factory, kwargs, input, classes, seed, path) and writes the file;
    the draw is deterministic, so two processes drawing the same file at once write the same bytes, and the file
    appears whole (written aside, then renamed). Raises NativeModelError (field ``model``) with the module's last
    line when it fails."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    argument = json.dumps({"factory": model.factory, "kwargs": model.kwargs, "seed": seed, "path": str(path),
                           "classes": classes, "input": {"kind": input.kind, "shape": list(input.shape),
                                                         "vocab": input.vocab, "per_position": input.per_position}})
    proc = subprocess.run([python or sys.executable, "-m", module, argument], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": _pythonpath()})
    if proc.returncode != 0 or not path.exists():
        last = next((line.strip() for line in reversed(proc.stderr.splitlines()) if line.strip()), "")
        raise NativeModelError("model", f"drawing the initial weights of {model.factory} failed: {last[:300]}")
    return path


def _pythonpath() -> str:
    """PYTHONPATH with the folder that holds the harness first (the drawing module is ``adapters.<family>...``)."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def _shown(kwargs: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return text if len(text) <= 80 else text[:77] + "..."
