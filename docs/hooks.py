"""MkDocs hooks: the reference pages generated from the code when the site is built.

A page under docs/reference/ holds a marker line, ``<!-- generated: NAME -->``; ``on_page_markdown`` replaces it with
``GENERATORS[NAME]()``: the spec's fields from the pydantic models of ``harness.spec``, the command line from the
argparse parser of ``harness.cli``, the trial record from ``harness.results.schema.TrialRecord`` and the text of
results/README.md. Nothing generated is written into docs/: the pages in git hold only the marker, so they cannot go
stale. Every function here is deterministic (no dates, no terminal width), so two builds give the same pages.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: ([a-z_-]+) -->$", re.MULTILINE)


# ---------------------------------------------------------------------------------------------------------------- util

def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped outside code spans (Python-Markdown
    reads a pipe inside one as text), reST double backticks as code, and angle
    brackets outside code spans escaped (docstrings write placeholders such as <name>, which HTML would swallow)."""
    text = " ".join(str(text).split()).replace("``", "`")
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "`".join(parts)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _prose(doc: str | None) -> str:
    return _cell(inspect.cleandoc(doc)) if doc else ""


# ------------------------------------------------------------------------------------------------------- spec fields

def _models_from(root: type[BaseModel]) -> list[type[BaseModel]]:
    """Every pydantic model reachable from ``root``'s field annotations, in the order first met."""
    seen: list[type[BaseModel]] = []

    def walk(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                return
            seen.append(tp)
            for field in tp.model_fields.values():
                walk(field.annotation)
            return
        for arg in typing.get_args(tp):
            walk(arg)

    walk(root)
    return seen


def _type(tp: Any, models: list[type[BaseModel]]) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type(args[0], models)
    if origin is typing.Literal:
        return " \\| ".join(f'`{value!r}`' if not isinstance(value, str) else f'`"{value}"`' for value in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(arg, models) for arg in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if arg is Ellipsis else _type(arg, models) for arg in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(tp, type) and issubclass(tp, BaseModel) and tp in models:
        return f"[{tp.__name__}](#{_anchor(tp.__name__)})"
    if isinstance(tp, type):
        return tp.__name__
    return _cell(repr(tp)).replace("typing.", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(its defaults)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


_CONSTRAINTS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >= {}",
                "max_length": "length <= {}", "pattern": "matches `{}`"}


def _constraints(field: Any) -> str:
    out = []
    for item in field.metadata:
        for attr, form in _CONSTRAINTS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(form.format(value) if "{}" in form else f"{form} {value}")
    return ", ".join(out)


def _field_notes(model: type[BaseModel]) -> tuple[str, dict[str, str]]:
    """The class docstring split into its introduction and the passages that begin with a field's name
    (``name: ...`` or ````name````: ...), which this project's docstrings use to describe fields."""
    doc = inspect.cleandoc(model.__doc__ or "")
    if model.__doc__ is None or model.__doc__ == BaseModel.__doc__:
        return "", {}
    names = "|".join(re.escape(name) for name in model.model_fields)
    if not names:
        return _cell(doc), {}
    label = re.compile(rf"(?:(?<=^)|(?<=\n)|(?<=\. )|(?<=\n\n))(?:``)?({names})(?:``)?: ")
    marks = list(label.finditer(doc))
    if not marks:
        return _cell(doc), {}
    intro = doc[:marks[0].start()]
    notes: dict[str, str] = {}
    for mark, following in zip(marks, marks[1:] + [None]):
        end = following.start() if following else len(doc)
        notes[mark.group(1)] = (notes.get(mark.group(1), "") + " " + doc[mark.end():end]).strip()
    return _cell(intro), {name: _cell(text) for name, text in notes.items()}


def spec_reference() -> str:
    from harness.spec import Spec

    models = _models_from(Spec)
    lines = [f"{len(models)} models, starting from `Spec` (the whole file). Every model is strict: a key not listed "
             "here is an error. Types link to the model that describes them.", ""]
    for model in models:
        intro, notes = _field_notes(model)
        lines += [f"### {model.__name__} {{#{_anchor(model.__name__)}}}", ""]
        if intro:
            lines += [intro, ""]
        lines += ["| field | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            description = field.description or notes.get(name, "")
            lines.append(f"| `{name}` | {_type(field.annotation, models)} | {_default(field)} | "
                         f"{_cell(_constraints(field))} | {_cell(description)} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------- CLI

def _build_parser() -> argparse.ArgumentParser:
    import harness.cli as cli

    build = getattr(cli, "build_parser", None) or cli._parser
    return build()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name) or "", sub))
    return out


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100, max_help_position=40)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
        return None
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar or (action.dest.upper() if not action.choices else None)
        if action.choices:
            names += " " + "{" + ",".join(str(choice) for choice in action.choices) + "}"
        elif metavar:
            names += f" {metavar if isinstance(metavar, str) else ' '.join(metavar)}"
    elif action.choices:
        names += " {" + ",".join(str(choice) for choice in action.choices) + "}"
    formatter = argparse.HelpFormatter(parser.prog)
    text = formatter._expand_help(action) if action.help else ""
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    positional_required = not action.option_strings and action.nargs not in ("?", "*", argparse.REMAINDER)
    required = "required" if action.required or positional_required else ""
    return f"| {_cell(names)} | {required} | {_cell(shown)} | {_cell(text)} |"


def _command(lines: list[str], path: str, help_text: str, parser: argparse.ArgumentParser, level: int) -> None:
    lines += [f"{'#' * level} {path} {{#{_anchor(path)}}}", ""]
    if help_text:
        lines += [_cell(help_text[0].upper() + help_text[1:]) + ".", ""]
    if parser.description and parser.description != help_text:
        lines += [_cell(parser.description), ""]
    lines += ["```text", _usage(parser), "```", ""]
    rows = [row for row in (_option_row(parser, action) for action in parser._actions) if row]
    if rows:
        lines += ["| argument | | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for name, sub_help, sub in _subcommands(parser):
        _command(lines, f"{path} {name}", sub_help, sub, min(level + 1, 4))


def cli_reference() -> str:
    parser = _build_parser()
    parser.prog = "harness"
    lines = [_cell(parser.description or ""), "",
             "`python -m harness` is the same program (inside `.venv`, or wherever the package is installed).", ""]
    for name, help_text, sub in _subcommands(parser):
        sub.prog = f"harness {name}"
        for sub_name, _, subsub in _subcommands(sub):
            subsub.prog = f"harness {name} {sub_name}"
        _command(lines, f"harness {name}", help_text, sub, 3)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- results schema

def _schema_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in prop:
        return " \\| ".join(_schema_type(option) for option in prop["anyOf"])
    if "enum" in prop:
        return " \\| ".join(f'`"{value}"`' if isinstance(value, str) else f"`{value}`" for value in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']!r}`"
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"array of {_schema_type(prop['items'])}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"object of {_schema_type(prop['additionalProperties'])}"
    return str(kind)


def _schema_table(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    lines = ["| field | type | required | description |", "| --- | --- | --- | --- |"]
    for name, prop in schema.get("properties", {}).items():
        lines.append(f"| `{name}` | {_schema_type(prop)} | {'yes' if name in required else ''} | "
                     f"{_cell(prop.get('description', ''))} |")
    return lines


def results_reference() -> str:
    from harness.results.schema import SCHEMA_VERSION, TrialRecord

    schema = TrialRecord.model_json_schema()
    lines = [f"Schema version {SCHEMA_VERSION}. `harness schema` prints this JSON Schema; "
             "`results/trial.schema.json` holds a copy (a test keeps the two equal).", "",
             f"### {schema.get('title', 'TrialRecord')} {{#{_anchor(schema.get('title', 'TrialRecord'))}}}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    lines += _schema_table(schema) + [""]
    for name, definition in sorted(schema.get("$defs", {}).items()):
        lines += [f"### {name} {{#{_anchor(name)}}}", ""]
        if definition.get("description"):
            lines += [_cell(definition["description"]), ""]
        if definition.get("properties"):
            lines += _schema_table(definition) + [""]
        else:
            lines += [f"Type: {_schema_type(definition)}.", ""]
    return "\n".join(lines)


def results_readme() -> str:
    """results/README.md without its title, its headings one level down, under the page's own."""
    text = (ROOT / "results" / "README.md").read_text()
    # GitHub needs \| for a pipe inside a code span in a table; Python-Markdown shows the backslash.
    text = re.sub(r"`[^`\n]*`", lambda m: m.group(0).replace("\\|", "|"), text)
    text = re.sub(r"^(#{1,5}) ", lambda m: "#" * (len(m.group(1)) + 1) + " ", text, flags=re.MULTILINE)
    return text.split("\n", 1)[1].strip() if text.startswith("## Results\n") else text.strip()


GENERATORS: dict[str, Callable[[], str]] = {
    "spec": spec_reference,
    "cli": cli_reference,
    "results-schema": results_reference,
    "results-readme": results_readme,
}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by what its generator writes; an unknown name is an error."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown)
