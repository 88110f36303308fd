"""A model of your own for the JAX adapter: a Flax module, linen or nnx, made the training mechanics' ``Functional``
(``adapters.jax.training``: ``apply(params, state, x, train, key) -> (logits, new state)``), so that the mechanisms
of the neutral model (one ``jax.jit`` of the step, gradient accumulation, data parallelism over a mesh, the loader,
fp32 and tf32) train it unchanged. Flax is imported when a model is adopted, never by the adapter itself.

- **linen** (``flax.linen.Module``; https://flax.readthedocs.io/en/latest/api_reference/flax.linen/module.html):
  ``module.init({"params": k1, "dropout": k2}, x, train=False)`` on one zero sample, with ``k1, k2 =
  jax.random.split(jax.random.PRNGKey(seed))``: the initial parameters follow the trial's seed. The training flag
  is Flax's convention, an argument of ``__call__``: ``train: bool`` (True while training), or ``deterministic:
  bool`` (its negation: False while training); a module whose ``__call__`` takes neither is called with the input
  alone and must have no batch statistics. Collections: ``params`` (trained) and ``batch_stats`` (the state:
  mutable in training, ``mutable=["batch_stats"]``, read-only in inference); ``intermediates`` (``sow``) is dropped;
  any other collection is refused. Dropout draws from the ``dropout`` rng, the step's key.
- **nnx** (``flax.nnx.Module``; https://flax.readthedocs.io/en/latest/nnx_basics.html): ``nnx.split(module,
  nnx.Param, nnx.BatchStat, ...)`` into the graph definition, the parameters (trained), the batch statistics (the
  state) and the rest (held fixed: rng streams, other variables), as pure dicts of arrays; ``nnx.merge`` rebuilds it
  inside the traced step. Training and inference are nnx's own ``module.train()`` / ``module.eval()`` (they set
  ``deterministic`` and ``use_running_average`` on its layers): one graph definition for each. Every rng stream's
  key is replaced by the step's key (folded with the stream's index) in training. nnx draws the parameters when the
  module is built, in the factory with the ``nnx.Rngs`` it chooses: a factory that takes a ``seed`` parameter is
  given the trial's (``harness.neutral.native.make``) and can build its ``nnx.Rngs(seed)``; else the seed does not
  reach them.

Precision: the harness's fp32 and tf32 reach a Flax module through ``jax_default_matmul_precision``, which its layers
use (their ``precision`` defaults to None); bf16 and fp16 cannot be imposed: a Flax layer computes in its ``dtype``
attribute, the module author's choice (the declaration's ``Limit``s say so). Synchronised batchnorm is the module's
own (linen and nnx ``BatchNorm(axis_name=...)``), so the harness cannot turn it on either.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapters.jax.runtime import jax, jnp
from adapters.jax.training import Functional
from harness.neutral.native import NativeModelError, NativeSource, output_logits

#: What ``adopt`` accepts, in words (the declaration's ``native_model``).
TYPES = "flax.linen.Module or flax.nnx.Module"
#: linen collections: trained, carried as the state, dropped.
PARAMS, STATE, DROPPED = "params", "batch_stats", ("intermediates",)


@dataclass(frozen=True)
class Adopted:
    """A Flax module as the mechanics train it: ``model`` (the ``Functional``, its ``params`` and ``state`` nested
    dicts of arrays) and what the record says of it (``settings``: the API, the training flag, where the initial
    parameters came from)."""

    model: Functional
    settings: dict[str, str]


def adopt(model: object, source: NativeSource, device: Any) -> Adopted:
    """``model`` (what ``source.factory`` returned) as a ``Functional``, its initial state made on ``device``. Raises
    NativeModelError (field ``model``) for an object that is not a linen or nnx module, or one this cannot train (a
    linen module with batch statistics but no training flag, or with another mutable collection)."""
    try:
        from flax import linen, nnx
    except ImportError:  # no flax here: the object cannot be a Flax module
        linen = nnx = None
    if linen is not None and isinstance(model, linen.Module):
        return _linen(model, source, device)
    if nnx is not None and isinstance(model, nnx.Module):
        return _nnx(model, nnx)
    missing = "" if linen is not None else " (flax is not installed in this interpreter)"
    raise NativeModelError("model", f"{source.factory} returned a {type(model).__module__}."
                                    f"{type(model).__qualname__}, not a {TYPES}{missing}")


def logits_of(out: Any) -> Any:
    """A module's output as the logits: an array as it is, a model output's ``logits`` (transformers' Flax
    ``ModelOutput``), or the first element of a tuple or list. Raises TypeError for anything else."""
    return output_logits(out, jax.Array, "the module returned", "an array")


def _flag(module: Any) -> tuple[str, Callable[[bool], dict[str, bool]]]:
    """How a linen module's ``__call__`` is told training from inference: ``train`` (the flag), ``deterministic``
    (its negation), or nothing; (the setting's words, train -> keyword arguments)."""
    parameters = inspect.signature(module.__call__).parameters
    if "train" in parameters:
        return "__call__(x, train=True) in training, train=False in inference", lambda train: {"train": train}
    if "deterministic" in parameters:
        return ("__call__(x, deterministic=False) in training, deterministic=True in inference",
                lambda train: {"deterministic": not train})
    return "__call__(x): the module has no training flag", lambda train: {}


@functools.partial(jax.jit, static_argnums=(2, 3))
def _init(rngs: Any, sample: Any, module: Any, flags: tuple[tuple[str, bool], ...]) -> Any:
    """``module.init(rngs, sample, **flags)``, jitted (one compilation instead of one per op); a linen module is
    hashable by its class and fields, so an equal module adopted again reuses the compilation."""
    return module.init(rngs, sample, **dict(flags))


def _linen(module: Any, source: NativeSource, device: Any) -> Adopted:
    """A linen module initialised for ``source`` (``module.init`` jitted, on ``device``) and its ``apply``."""
    described, flag = _flag(module)
    params_key, dropout_key = jax.random.split(jax.random.PRNGKey(source.seed))
    sample = jnp.zeros((1, *source.input.shape), jnp.int32 if source.input.kind == "tokens" else jnp.float32)
    rngs, flags = {"params": params_key, "dropout": dropout_key}, tuple(flag(False).items())
    with jax.default_device(device):
        try:
            hash(module)
        except TypeError:  # a field that is not hashable (a list, a dict): jitted for this module alone
            variables = jax.jit(functools.partial(module.init, **dict(flags)))(rngs, sample)
        else:
            variables = _init(rngs, sample, module, flags)
    other = sorted(set(variables) - {PARAMS, STATE, *DROPPED})
    if other:
        raise NativeModelError("model", f"{source.factory} has the variable collection(s) {', '.join(other)}; the "
                                        f"jax adapter trains {PARAMS!r} and carries {STATE!r} only")
    state = {STATE: dict(variables[STATE])} if STATE in variables else {}
    if state and not flag(True):
        raise NativeModelError("model", f"{source.factory} has batch statistics but its __call__ takes no train "
                                        f"or deterministic argument, so training cannot update them")

    def apply(params: Any, state: Any, x: Any, train: bool, key: Any) -> tuple[Any, Any]:
        variables = {PARAMS: params, **state}
        if train and state:
            out, updated = module.apply(variables, x, rngs={"dropout": key}, mutable=list(state), **flag(True))
            return logits_of(out), {name: dict(updated[name]) for name in state}
        return logits_of(module.apply(variables, x, rngs={"dropout": key}, **flag(train))), state

    return Adopted(Functional(apply, dict(variables.get(PARAMS, {})), state), {
        "api": "flax.linen", "training_flag": described,
        "initial_parameters": "module.init with jax.random.PRNGKey(seed) (split into the params and dropout rngs)"})


def _nnx(module: Any, nnx: Any) -> Adopted:
    """An nnx module split into its graph definitions (training and inference), parameters, batch statistics and
    the rest, and the function that merges them back and calls it."""
    def split(mode: Callable[[], Any]) -> tuple[Any, Any, Any, Any]:
        mode()
        return tuple(nnx.split(module, nnx.Param, nnx.BatchStat, ...))
    eval_graph = split(module.eval)[0]
    train_graph, params, stats, rest = split(module.train)  # left in training mode, as it came (nnx's default)

    def rebuilt(pure: Any, template: Any) -> Any:
        """A pure dict (the mechanics' pytree) as an ``nnx.State`` like ``template`` (a copy whose values are replaced
        path by path: ``nnx.replace_by_pure_dict``)."""
        state = jax.tree_util.tree_map(lambda value: value, template)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def reseeded(key: Any) -> Any:
        """The rest with every rng stream's key made the step's ``key`` folded with the stream's index."""
        leaves, tree = jax.tree_util.tree_flatten(rest)
        base, count = jax.random.wrap_key_data(key), 0
        out = []
        for leaf in leaves:
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf, count = jax.random.fold_in(base, count), count + 1
            out.append(leaf)
        return jax.tree_util.tree_unflatten(tree, out)

    def apply(trained: Any, state: Any, x: Any, train: bool, key: Any) -> tuple[Any, Any]:
        merged = nnx.merge(train_graph if train else eval_graph, rebuilt(trained, params), rebuilt(state, stats),
                           reseeded(key) if train else rest, copy=True)
        out = logits_of(merged(x))
        return out, (nnx.split(merged, nnx.Param, nnx.BatchStat, ...)[2].to_pure_dict() if train else state)

    return Adopted(Functional(apply, params.to_pure_dict(), stats.to_pure_dict()), {
        "api": "flax.nnx", "training_flag": "module.train() in training, module.eval() in inference (nnx's own)",
        "initial_parameters": "the factory's (nnx draws them when the module is built: from the trial's seed where "
                              "the factory takes a seed parameter)"})
