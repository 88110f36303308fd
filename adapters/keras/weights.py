"""The initial weights a model of your own starts from on every Keras backend: drawn once per seed with Keras's numpy
backend, saved as a Keras weights file, and loaded by each backend's adapter (``KerasAdapter.native_model``), so that
Keras on JAX, PyTorch and TensorFlow train the same model from the same numbers (each backend's own initialisers draw
different ones from the same seed: ``jax.random``, ``torch.Generator``, TensorFlow's stateless ops).

Run as ``python -m adapters.keras.weights '<json>'`` by ``harness.neutral.native.draw_shared_weights`` (the
declarations' ``shared_weights``) with {factory, kwargs, seed, path, classes, input}: KERAS_BACKEND is set to
``numpy`` before Keras is imported (https://keras.io/getting_started/#configuring-your-backend), the seed with
``keras.utils.set_random_seed``, the factory called (``harness.neutral.native.make``) in the float32 policy, the model
built for the input where it is built lazily (``build_for``), and its weights saved (``Model.save_weights``,
https://keras.io/api/models/model_saving_apis/weights_saving_and_loading/) aside, beside ``path``, then renamed onto
it (``os.replace``): the file appears whole, and two processes that draw it at once write the same bytes. A Keras
weights file holds the variables by the model's structure (layer classes in order, not their generated names) and
not by backend, so every backend loads it (``load``). Keras's numpy backend imports JAX (its convolutions are
``jax.lax``'s), so every Keras environment has JAX (requirements/keras-*.txt); the draw keeps JAX on the CPU.

Exit status 0 when the file is written; 1 with one line on stderr (the reason) when the factory fails or gives no
``keras.Model``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

#: The backend the weights are drawn on: its random ops are numpy's (``np.random.default_rng`` of Keras's seeds), the
#: same numbers in every environment and on every machine.
DRAW_BACKEND = "numpy"


def build_for(model: Any, feed: Any) -> None:
    """Builds ``model`` (a ``keras.Model``) for samples of ``feed`` (``harness.neutral.info.Input``: (B, *shape))
    when it is not built yet (a ``keras.Sequential`` without an ``Input``, a subclassed model): Keras creates a
    layer's variables at its first call (https://keras.io/guides/making_new_layers_and_models_via_subclassing/)."""
    if not model.built:
        model.build((None, *feed.shape))


def load(model: Any, path: Path) -> None:
    """``model.load_weights`` of the weights file at ``path``, whatever it is named: Keras reads a file by its name's
    ending (``.weights.h5``), and the harness names the shared file by a hash (``harness.neutral.native
    .shared_weights_path``), so it is loaded through a link of that name in a temporary folder. Raises ValueError
    when the file holds another model's variables (Keras's), or when Keras loaded only part of the model (its
    warning "Skipping nested container ...": those layers keep their own initialisation, which differs per backend).
    Keras's other warnings pass on."""
    with tempfile.TemporaryDirectory(prefix="keras-weights-") as folder, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        link = Path(folder) / "initial.weights.h5"
        link.symlink_to(Path(path).resolve())
        model.load_weights(link)
    for warning in seen:
        if str(warning.message).startswith("Skipping nested container"):
            raise ValueError(f"Keras loaded only part of the model: {warning.message}")
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def draw(request: dict[str, Any]) -> Path:
    """The weights of ``request``'s model for its seed, drawn on Keras's numpy backend and written to its ``path``.
    Raises ``harness.neutral.native.NativeModelError`` when the factory fails or returns no ``keras.Model``, and
    RuntimeError when Keras was already imported on another backend in this process."""
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != DRAW_BACKEND:
        raise RuntimeError(f"Keras was imported on the {sys.modules['keras'].backend.backend()} backend before the "
                           f"weights could be drawn on the {DRAW_BACKEND} one")
    os.environ["KERAS_BACKEND"] = DRAW_BACKEND
    os.environ["JAX_PLATFORMS"] = "cpu"  # the numpy backend's jax.lax ops: never a GPU's memory
    import keras

    from harness.neutral.info import Input
    from harness.neutral.native import NativeModelError, make
    from harness.spec import NativeModel

    spec = NativeModel(factory=request["factory"], kwargs=request.get("kwargs") or {})
    shape = request["input"]
    feed = Input(shape["kind"], tuple(shape["shape"]), int(shape.get("vocab") or 0), bool(shape.get("per_position")))
    keras.utils.set_random_seed(int(request["seed"]))
    keras.config.set_dtype_policy("float32")
    model = make(spec)
    if not isinstance(model, keras.Model):
        raise NativeModelError("model", f"{spec.factory} returned a {type(model).__module__}."
                                        f"{type(model).__qualname__}, not a keras.Model")
    build_for(model, feed)
    path = Path(request["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, aside = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".weights.h5")
    os.close(handle)
    try:
        model.save_weights(aside)
        os.chmod(aside, 0o644)  # mkstemp's file is its owner's alone; the cache is read by every run
        os.replace(aside, path)
    finally:
        if os.path.exists(aside):
            os.unlink(aside)
    return path


def main(argv: list[str]) -> int:
    """``draw`` of the JSON request ``argv[0]``; 0, or 1 with the reason as the last line of stderr."""
    from harness.neutral.native import NativeModelError

    try:
        draw(json.loads(argv[0]))
    except NativeModelError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
