"""Docstrings and comments name only what exists: every reference to the project's own code
(``harness.plan.support.unsupported``, ``Adapter.gradient_norms``, ``self._mesh``, `Capabilities.loader`) in a
docstring or comment of ``harness``, ``adapters``, benchmarks/, scripts/ and tests/, and in README.md and docs/ (not
the dated findings, which describe the code as it was), resolves to a module, class, function, method, attribute or
field defined in the project.

The index of definitions is built from the ASTs (nothing is imported: the adapters' modules import frameworks that
live in other environments): module paths; each module's top-level names (functions, classes, assignments, imports,
under ``if TYPE_CHECKING:`` too); each class's methods, class-level assignments and annotated fields (dataclass and
pydantic fields), nested classes, and the ``self.x`` it assigns in its methods, with what it inherits from the
project's classes (a member of an unknown base, ``nn.Module``'s, passes). Which references are checked (the rest is
prose and other projects' names): a dotted name in backticks, or written bare but starting with ``harness.`` or
``adapters.``, whose first part is ``harness``, ``adapters``, a class defined in the project, or (inside a class)
``self``, or whose first parts are the tail of a module's path (``plan.support``, ``execution.protocol``); in the
adapters ``options.x`` is ``RunOptions.x``. A framework's name (``jax.devices``, ``keras.Model``) is never checked,
even where the project has a module of that name. Only the first member after a class is checked: what an attribute
holds is not known here. The convention: docs/design/docstrings.md.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "adapters")

#: First parts that name a framework or a library, never the project's code, even where the project has a module or
#: class of that name (``adapters.jax``, ``adapters.keras``).
FOREIGN = frozenset({"torch", "jax", "jnp", "jaxlib", "np", "numpy", "tf", "tensorflow", "keras", "mx", "mxnet",
                     "nn", "optax", "flax", "grain", "pd", "pandas", "plt", "matplotlib", "scipy", "ray", "mlflow",
                     "pydantic", "pynvml", "psutil", "os", "sys", "time", "threading", "multiprocessing", "subprocess",
                     "signal", "resource", "json", "yaml", "gluon", "autograd", "xla", "lax", "torchrun", "cuda"})
#: Members every instance of these external bases has, so that ``Spec.model_fields`` or ``Kind.value`` resolves.
EXTERNAL_MEMBERS = {
    "BaseModel": {"model_fields", "model_dump", "model_dump_json", "model_copy", "model_validate",
                  "model_validate_json", "model_json_schema", "model_config", "model_fields_set", "model_extra"},
    "Enum": {"name", "value"}, "str": set(), "int": set(), "object": set(), "ABC": set(), "Protocol": set(),
    "Generic": set(), "NamedTuple": {"_fields", "_replace", "_asdict"}, "TypedDict": set(),
    "Exception": {"args"}, "RuntimeError": {"args"}, "ValueError": {"args"}, "KeyError": {"args"},
    "TypeError": {"args"}, "OSError": {"args", "errno"}, "MemoryError": {"args"},
}
#: Names that, in the adapters, always mean an instance of one class: ``options.loader`` is ``RunOptions.loader``.
INSTANCES = {"options": "RunOptions"}
#: A dotted name in double or single backticks, maybe called (``prepare(device, threads, seed)``).
QUOTED = re.compile(r"``([^`\n]+)``|(?<!`)`([^`\n]+)`(?!`)")
NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
BARE = re.compile(r"(?<![\w./`-])((?:harness|adapters)(?:\.[A-Za-z_]\w*)+)")
#: A triple-quoted string: the docstrings of the files outside the packages, read without parsing them.
TRIPLE = re.compile(r"(\"\"\"|\'\'\')(.*?)\1", re.S)
#: A documentation page named in a docstring or comment, maybe with a heading's anchor.
PAGE = re.compile(r"(?<![\w/])(docs/[\w/.-]+\.md)(?:#([\w-]+))?")


@dataclass
class Class:
    name: str
    module: str
    members: set[str] = field(default_factory=set)
    nested: dict[str, Class] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    source: str
    names: set[str] = field(default_factory=set)
    classes: dict[str, Class] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local name -> (module, name or None)
    lazy: bool = False  # a module __getattr__: any member may exist


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for element in node.elts for name in _targets(element)]
    return []


def _class(node: ast.ClassDef, module: str) -> Class:
    cls = Class(node.name, module, bases=[ast.unparse(base).rsplit(".", 1)[-1].split("[")[0] for base in node.bases])
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cls.members.add(item.name)
            for sub in ast.walk(item):  # self.x = ..., self.x: T = ..., self.x, self.y = ...
                targets = (sub.targets if isinstance(sub, ast.Assign) else
                           [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                for target in targets:
                    for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name)
                                and element.value.id in ("self", "cls")):
                            cls.members.add(element.attr)
        elif isinstance(item, ast.ClassDef):
            cls.nested[item.name] = _class(item, module)
            cls.members.add(item.name)
        elif isinstance(item, ast.Assign):
            cls.members.update(name for target in item.targets for name in _targets(target))
        elif isinstance(item, ast.AnnAssign):
            cls.members.update(_targets(item.target))
    return cls


def _resolve_from(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, with those under ``if TYPE_CHECKING:``, ``try:`` and the like."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            out += _top_level(node.body + node.orelse + [n for h in getattr(node, "handlers", []) for n in h.body])
    return out


@functools.cache
def _index() -> dict[str, Module]:
    """Every module of ``PACKAGES`` by its dotted name, with what it defines."""
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            source = path.read_text(encoding="utf-8")
            module = modules[name] = Module(name, path, ast.parse(source), source)
            for node in _top_level(module.tree.body):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    module.names.add(node.name)
                    module.lazy |= node.name == "__getattr__"
                elif isinstance(node, ast.ClassDef):
                    module.names.add(node.name)
                    module.classes[node.name] = _class(node, name)
                elif isinstance(node, ast.Assign):
                    module.names.update(n for target in node.targets for n in _targets(target))
                elif isinstance(node, ast.AnnAssign):
                    module.names.update(_targets(node.target))
                elif isinstance(node, ast.ImportFrom):
                    source = _resolve_from(name, node, path.name == "__init__.py")
                    for alias in node.names:
                        module.imports[alias.asname or alias.name] = (source, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        module.imports[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0], None)
    return modules


class Resolver:
    """Whether a dotted name resolves in the index."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self.classes: dict[str, list[Class]] = {}
        for module in modules.values():
            for cls in module.classes.values():
                self.classes.setdefault(cls.name, []).append(cls)
        self.tails: dict[str, list[str]] = {}  # "plan.support" -> ["harness.plan.support"]
        for name in modules:
            parts = name.split(".")
            for start in range(1, len(parts) - 1):
                self.tails.setdefault(".".join(parts[start:]), []).append(name)

    def _class_has(self, cls: Class, member: str, seen: set[int] | None = None) -> bool | None:
        """True or False; None when an unknown (external) base may define it."""
        if member in cls.members or member.startswith("__"):
            return True
        seen = seen or set()
        seen.add(id(cls))
        unknown = False
        for base in cls.bases:
            if base in EXTERNAL_MEMBERS and base not in self.classes:
                if member in EXTERNAL_MEMBERS[base]:
                    return True
                continue
            found = [self._class_has(parent, member, seen) for parent in self.classes.get(base, [])
                     if id(parent) not in seen]
            if any(found):
                return True
            if not found and base not in self.classes:
                unknown = True
            if None in found:
                unknown = True
        return None if unknown else False

    def _in_class(self, cls: Class, rest: list[str]) -> bool:
        if not rest:
            return True
        has = self._class_has(cls, rest[0])
        if has is None:
            return True
        if not has:
            return False
        if rest[0] in cls.nested:
            return self._in_class(cls.nested[rest[0]], rest[1:])
        return True  # a method or an attribute: what its value holds is not known here

    def _in_module(self, module: Module, rest: list[str], depth: int = 0) -> bool:
        if not rest or depth > 8:
            return True
        head, tail = rest[0], rest[1:]
        sub = f"{module.name}.{head}"
        if sub in self.modules:
            return self._in_module(self.modules[sub], tail, depth + 1)
        if head in module.classes:
            return self._in_class(module.classes[head], tail)
        if head in module.names or head.startswith("__"):
            return True
        if head in module.imports:
            source, name = module.imports[head]
            target = f"{source}.{name}" if name else source
            if target in self.modules:
                return self._in_module(self.modules[target], tail, depth + 1)
            if source in self.modules and name is not None:
                return self._in_module(self.modules[source], [name, *tail], depth + 1)
            return True  # another project's name, re-exported
        return module.lazy

    def check(self, dotted: str, cls: Class | None) -> bool | None:
        """Whether ``dotted`` resolves; None when it is not a reference this check judges."""
        parts = dotted.split(".")
        first = parts[0]
        if first in FOREIGN:
            return None
        if first in PACKAGES:
            for cut in range(len(parts), 0, -1):
                name = ".".join(parts[:cut])
                if name in self.modules:
                    return self._in_module(self.modules[name], parts[cut:])
            return False
        if first == "self":
            return None if cls is None else self._in_class(cls, parts[1:])
        if first in self.classes:
            return any(self._in_class(found, parts[1:]) for found in self.classes[first])
        for cut in range(len(parts), 1, -1):
            for name in self.tails.get(".".join(parts[:cut]), []):
                if self._in_module(self.modules[name], parts[cut:]):
                    return True
            if ".".join(parts[:cut]) in self.tails:
                return False
        return None


def _docstrings(tree: ast.Module) -> list[tuple[ast.Constant, Class | None, str | None]]:
    """Every docstring-like string (a module's, class's or function's, and a string statement after an attribute),
    with the class it belongs to by name, if any."""
    out: list[tuple[ast.Constant, str | None]] = []

    def visit(body: list[ast.stmt], cls: str | None) -> None:
        for node in body:
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                out.append((node.value, cls))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, node.name if cls is None else cls)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, cls)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body, cls)

    visit(tree.body, None)
    return out


def _references(text: str) -> list[tuple[int, str]]:
    """(line offset within ``text``, dotted name) for each candidate reference."""
    found: list[tuple[int, str]] = []
    for match in QUOTED.finditer(text):
        content = (match.group(1) or match.group(2)).strip()
        named = NAME.match(content)
        if named:
            found.append((text.count("\n", 0, match.start()), named.group(1)))
    stripped = QUOTED.sub(lambda m: " " * len(m.group(0)), text)
    for match in BARE.finditer(stripped):
        found.append((stripped.count("\n", 0, match.start()), match.group(1)))
    return found


def _comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment of ``source``: a line that starts with ``#``, or what follows ``  # `` (PEP 8's
    inline comment; read from the text, as tokenizing every file took most of this test's time)."""
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.lstrip()
        if stripped.startswith("#"):
            out.append((number, stripped))
        elif "  # " in line:
            out.append((number, line.split("  # ", 1)[1]))
    return out


def _texts(path: Path, module: Module | None) -> list[tuple[int, str, str | None]]:
    """(first line, text, enclosing class name) of each docstring and comment of a Python file, or the whole of a
    Markdown file."""
    source = module.source if module is not None else path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return [(1, source, None)]
    if module is None:  # outside the packages: every triple-quoted string, read from the text (parsing took longer)
        strings = [(source.count("\n", 0, match.start()) + 1, match.group(2), None)
                   for match in TRIPLE.finditer(source)]
    else:
        strings = [(node.lineno, node.value, cls) for node, cls in _docstrings(module.tree)]
    return strings + [(line, text, None) for line, text in _comments(source)]


def _other_files() -> list[Path]:
    """The other places that name the project's code: benchmarks, scripts, tests, and the documentation that
    describes the code as it is (README.md, docs/ but for the dated findings, which describe it as it was)."""
    python = [path for folder in ("benchmarks", "scripts", "tests") for path in sorted((ROOT / folder).rglob("*.py"))
              if path != Path(__file__).resolve()]  # this file names stale references on purpose
    pages = [ROOT / "README.md", *sorted(path for path in (ROOT / "docs").rglob("*.md")
                                         if "findings" not in path.relative_to(ROOT / "docs").parts)]
    return python + pages


def stale_references(modules: dict[str, Module] | None = None, others: list[Path] | None = None
                     ) -> tuple[list[str], int]:
    """``path:line: reference`` for every reference that does not resolve, and how many references were checked."""
    modules = modules if modules is not None else _index()
    others = others if others is not None else _other_files()
    resolver = Resolver(modules)
    sources = [(module.path, module) for module in modules.values()] + [(path, None) for path in others]
    stale, checked = [], 0
    for path, module in sources:
        instances = INSTANCES if path.relative_to(ROOT).parts[0] == "adapters" else {}
        for line, text, class_name in _texts(path, module):
            cls = module.classes.get(class_name) if module is not None and class_name else None
            for offset, dotted in _references(text):
                first, _, rest = dotted.partition(".")
                if first in instances:
                    dotted = f"{instances[first]}.{rest}"
                verdict = resolver.check(dotted, cls)
                if verdict is None:
                    continue
                checked += 1
                if not verdict:
                    stale.append(f"{path.relative_to(ROOT)}:{line + offset}: {dotted}")
    return stale, checked


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings as MkDocs's toc makes them (``{#id}`` where one is given)."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S),
                              flags=re.M):
        given = re.search(r"\{#([\w-]+)\}", heading)
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        anchors.add(given.group(1) if given else re.sub(r"[-\s]+", "-", slug))
    return anchors


def missing_pages(modules: dict[str, Module]) -> list[str]:
    """``path:line: page#anchor`` for every page of docs/ that a docstring or comment of the packages names and
    that does not exist, or lacks the heading its anchor names."""
    missing = []
    for module in modules.values():
        for line, text, _ in _texts(module.path, module):
            for match in PAGE.finditer(text):
                page, anchor = ROOT / match.group(1), match.group(2)
                if not page.is_file() or (anchor and anchor not in _anchors(page)):
                    missing.append(f"{module.path.relative_to(ROOT)}:{line + text.count(chr(10), 0, match.start())}: "
                                   f"{match.group(0)}")
    return missing


def test_docstrings_name_only_what_exists() -> None:
    stale, checked = stale_references()
    assert not stale, "docstrings name members that do not exist:\n" + "\n".join(stale)
    assert checked > 500  # the check reads the references it should


def test_docstrings_name_only_pages_and_headings_that_exist() -> None:
    """A docstring that moved its measurements to docs/ points at them: the page and its heading exist."""
    missing = missing_pages(_index())
    assert not missing, "docstrings name pages or headings that do not exist:\n" + "\n".join(missing)


def test_a_planted_stale_reference_is_found() -> None:
    """A docstring that names a method the class lacks, a module that does not exist, a function a module lacks and
    ``self`` attribute nobody sets fails the check, in a docstring or a comment; the framework's own names and plain
    prose do not."""
    modules = dict(_index())
    source = '''"""Uses ``Adapter.unsupported`` and ``harness.plan.nowhere`` and `harness.plan.support.unsupported`,
    ``jax.devices`` and ``record.attention``; also harness.plan.support.gone and ``plan.support.vanished``."""


class Thing:
    def __init__(self) -> None:
        self.kept = 1  # as ``harness.execution.loop.Loop.stage_ahead`` does

    def run(self) -> None:
        """Reads ``self.kept`` and ``self.lost``; ``Adapter.gradient_norms(batch, micro_batches)`` exists."""
'''
    path = ROOT / "harness" / "planted.py"
    modules["harness.planted"] = Module("harness.planted", path, ast.parse(source), source)
    modules["harness.planted"].classes["Thing"] = _class(modules["harness.planted"].tree.body[1], "harness.planted")
    stale, _ = stale_references(modules, others=[])
    assert sorted(line.split(": ", 1)[1] for line in stale if line.startswith("harness/planted.py")) == [
        "Adapter.unsupported", "harness.execution.loop.Loop.stage_ahead", "harness.plan.nowhere",
        "harness.plan.support.gone", "plan.support.vanished", "self.lost"]
    assert "harness/planted.py:1: Adapter.unsupported" in stale
    assert "harness/planted.py:10: self.lost" in stale


def test_a_planted_missing_page_or_heading_is_found() -> None:
    modules = dict(_index())
    source = '''"""See docs/design/max-batch.md#the-cpu-memory-cap, docs/design/max-batch.md#no-such-heading and
    docs/design/nowhere.md."""
'''
    path = ROOT / "harness" / "planted.py"
    modules["harness.planted"] = Module("harness.planted", path, ast.parse(source), source)
    assert [line for line in missing_pages(modules) if line.startswith("harness/planted.py")] == [
        "harness/planted.py:1: docs/design/max-batch.md#no-such-heading",
        "harness/planted.py:2: docs/design/nowhere.md"]
