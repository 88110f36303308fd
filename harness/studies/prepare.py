"""A spec made ready to run: what its dataset needs before the first trial, done once in this process, and the
checks that need the model, the data and the adapters (``harness.plan.check``). The CLI's commands and the Python API
(``harness.api``) both start here."""

from __future__ import annotations

import os
import sys

from harness.spec import Spec


def ready(spec: Spec, file: str | os.PathLike[str], offline: bool = False, progress: bool | None = None) -> Spec:
    """``spec`` with its data ready before the first trial.

    What the dataset needs from the network (``harness.neutral.download.fetch_dataset``: CIFAR-10 downloaded into the
    cache when it is missing there, unless ``offline`` or ``HARNESS_OFFLINE=1``), a generated image folder written,
    ``harness.plan.check``, then an image folder decoded into its cache (``harness.neutral.image_folder.prepare``), so
    that the workers only read arrays. Progress lines go to standard error; ``progress``: the download's bar
    (default: when standard error is a terminal).

    Args:
        spec: a validated spec (``harness.spec.load`` or ``harness.spec.from_data``).
        file: what errors name: the spec file, or a name for a spec made in code.

    Returns:
        ``spec`` itself.

    Raises:
        SpecError: one line naming ``file`` and the field; a dataset failure as ``FILE: dataset.FIELD: ...``.
    """
    from harness import plan
    from harness.neutral import download, image_folder
    from harness.neutral.datasets import DatasetError
    from harness.spec import ImageFolderData, SpecError

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        download.fetch_dataset(spec.dataset, offline=offline, log=log, progress=progress)
        if isinstance(spec.dataset, ImageFolderData) and spec.dataset.generate and not spec.dataset.path.exists():
            made = spec.dataset.generate
            log(f"writing {made.classes} x {made.per_class} generated images to {spec.dataset.path} (dataset.generate)")
            image_folder.make_image_folder(spec.dataset.path, made.classes, made.per_class, made.size, made.seed)
        plan.check(spec, file)
        if isinstance(spec.dataset, ImageFolderData):
            prepared = image_folder.prepare(spec.dataset, log=log)
            if prepared.decoded:
                log(f"decoded {prepared.train} training and {prepared.test} test images in {prepared.seconds:.1f} s")
            if prepared.skipped:
                shown = ", ".join(prepared.skipped[:3]) + (", ..." if len(prepared.skipped) > 3 else "")
                log(f"{file}: dataset.on_bad_file: skipped {len(prepared.skipped)} unreadable file(s) of "
                    f"{spec.dataset.path}: {shown}")
    except DatasetError as err:
        raise SpecError(file, f"dataset.{err.field or 'path'}", str(err)) from None
    return spec
