"""A spec's framework entries as commands name them: the entry a label or framework name means
(``entry_for``, ``entry_named``), and whether an adapter is registered under a name (``check_framework_name``)."""

from __future__ import annotations

import os

from harness.spec import FrameworkEntry, Spec, SpecError

__all__ = ["check_framework_name", "entry_for", "entry_named"]


def entry_for(spec: Spec, framework: str) -> FrameworkEntry:
    """The spec's framework entry whose label is ``framework``, else the first whose name is, else a plain entry of
    that name (the harness's own interpreter)."""
    entries = spec.entries
    return (next((e for e in entries if e.row == framework), None)
            or next((e for e in entries if e.name == framework), None) or FrameworkEntry(name=framework))


def entry_named(spec: Spec, name: str, file: str | os.PathLike[str], field: str = "--framework") -> FrameworkEntry:
    """The entry a command's ``--framework NAME`` means: the one labelled ``name``, else the only one of that
    framework; a framework the spec does not list is trained as a plain entry of that name only when the spec has a
    neutral model for it to build. Raises SpecError (one line naming ``field``): several entries of that framework
    and none labelled so (which one?), or a framework the spec does not list and cannot build."""
    if (labelled := next((e for e in spec.entries if e.row == name), None)) is not None:
        return labelled
    named = [e for e in spec.entries if e.name == name]
    if len(named) > 1:
        raise SpecError(file, field, f"{name} names {len(named)} entries (labels "
                                     f"{', '.join(e.row for e in named)}): give one of their labels")
    if named:
        return named[0]
    if spec.model is None:
        raise SpecError(file, field, f"{name} is not an entry of the spec (its entries: "
                                     f"{', '.join(e.row for e in spec.entries)}), and the spec has no neutral model "
                                     "for it to build")
    return FrameworkEntry(name=name)


def check_framework_name(name: str, file: str | os.PathLike[str], field: str = "frameworks",
                         backend: str | None = None) -> None:
    """Raises SpecError unless an adapter is registered under ``name`` (``adapters.available_names``). ``backend``:
    the entry's (``FrameworkEntry.backend``, already joined to ``name``): a family without that backend, or a
    framework that has none, is named with the fix. A family's own name ("keras") without a backend says to give
    one."""
    from adapters import available_names, backends  # the registry imports no framework

    known = available_names()
    if name in known:
        return
    where = f" at index {field.rsplit('.', 1)[1]}" if "." in field else ""
    if backend is not None:
        family = name[:-len(backend) - 1]
        if offered := backends(family):
            raise SpecError(file, f"{field}.backend", f"{family} has no backend {backend!r}; expected one of "
                                                      f"{', '.join(offered)}")
        families = sorted({n.split('-')[0] for n in known if backends(n.split('-')[0])})
        raise SpecError(file, f"{field}.backend", f"{family} takes no backend (only {', '.join(families)} "
                                                  "does); remove it" if family in known else
                        f"unknown framework {family!r}{where}; expected one of {', '.join(known)}")
    if offered := backends(name):
        raise SpecError(file, field, f"{name} runs on a backend: write {{name: {name}, backend: {offered[0]}}} "
                                     f"(backends: {', '.join(offered)})")
    raise SpecError(file, "frameworks", f"unknown framework {name!r}{where}; expected one of {', '.join(known)}")
