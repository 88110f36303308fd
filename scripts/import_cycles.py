"""Every import circle among the modules of ``harness`` and ``adapters``, as grimp (import-linter's graph) sees them:
imports inside functions (lazy ones) and under ``if TYPE_CHECKING`` count, since a circle is a design fault however
late it closes.

Usage: ``python scripts/import_cycles.py [--allow PACKAGE ...]`` from the repository root (the packages are imported
from the current directory). Prints, and exits 1 when there is any not allowed:

- each circle: a strongly connected component of the module graph with two modules or more (a package's
  ``__init__`` is a module of its own), with every import inside it and its line numbers;
- each module that imports the ``harness`` package itself (``from harness import __version__``): the top level's lazy
  ``harness.load_run`` hook reaches up to ``harness.results``, so such an import would close a circle through it
  (modules import ``harness.version`` instead).

``--allow PACKAGE``: circles whose modules all lie in PACKAGE are printed but tolerated (a package whose owners have
yet to untangle it). setup.cfg's ``acyclic_siblings`` contract checks the circles between the siblings of each
package on every ``lint-imports``; this script also finds those between a package and its own modules, and through
the top level. tests/test_layout.py runs it.
"""

from __future__ import annotations

import argparse
import sys

import grimp

PACKAGES = ("harness", "adapters")


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of ``graph``'s module graph with two modules or more, each sorted, in
    sorted order (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for i in range(position, len(edges[node])):
                target = edges[node][i]
                if target not in index:
                    work += [(node, i + 1), (target, 0)]
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return sorted(found)


def top_level_importers(graph: grimp.ImportGraph) -> list[str]:
    """The modules that import the ``harness`` package module itself (not one of its modules)."""
    return sorted(graph.find_modules_that_directly_import("harness")) if "harness" in graph.modules else []


def report(graph: grimp.ImportGraph, allow: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """(the lines to print, whether anything not allowed was found): see the module docstring."""
    lines: list[str] = []
    broken = False
    for component in circles(graph):
        allowed = any(all(m == p or m.startswith(p + ".") for m in component) for p in allow)
        broken |= not allowed
        lines.append(f"circle{' (allowed)' if allowed else ''}: {', '.join(component)}")
        for importer in component:
            for imported in sorted(set(graph.find_modules_directly_imported_by(importer)) & set(component)):
                details = graph.get_import_details(importer=importer, imported=imported)
                where = ", ".join(str(d["line_number"]) for d in details)
                lines.append(f"    {importer} -> {imported} (line {where})")
    for importer in top_level_importers(graph):
        broken = True
        lines.append(f"{importer} imports the harness package itself (import what it needs from its own module, "
                     "e.g. harness.version)")
    return lines, broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow", action="append", default=[], metavar="PACKAGE",
                        help="tolerate the circles whose modules all lie in PACKAGE (repeatable)")
    args = parser.parse_args(argv)
    sys.path.insert(0, ".")
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    lines, broken = report(graph, tuple(args.allow))
    print("\n".join(lines) if lines else "no import circles")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
