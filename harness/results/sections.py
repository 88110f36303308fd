"""The report as data: sections of typed blocks, computed once from a run (``harness.results.report.sections``) and
rendered twice, to Markdown here (``to_markdown``: report.md) and to HTML by ``harness.results.html``.

Text in blocks is plain text with a small inline subset that both renderers understand: `code` spans,
[text](link) links and the escaped star ``\\*``. Table cells are plain text; the Markdown renderer writes a ``|``
inside a cell as ``/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Align = Literal["left", "right"]


@dataclass(frozen=True)
class Paragraph:
    """One paragraph of text."""

    text: str


@dataclass(frozen=True)
class Lines:
    """Lines read together (a header's notes): in Markdown one line each with no blank line between."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class BulletList:
    """An unordered list, one item per entry."""

    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """A table: ``header`` (n column titles), ``rows`` (each n cells), ``align`` (n of left/right) and optional
    ``row_classes`` (one per row, e.g. ``bad`` for a trial that did not end ok; HTML only)."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    align: tuple[Align, ...]
    row_classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Images:
    """Images, one per line: (alt text, path relative to the run directory) each."""

    images: tuple[tuple[str, str], ...]


Block = Paragraph | Lines | BulletList | Table | Images


@dataclass(frozen=True)
class Section:
    """A titled part of the report: ``key`` names it for a renderer (``header``, ``ohio_state``, ``metric:<key>``,
    ``plots``...), ``level`` is its heading level (1 for the report's title, 2 for the rest)."""

    key: str
    title: str
    blocks: tuple[Block, ...] = field(default_factory=tuple)
    level: int = 2


def batch_table(rows: list[tuple[str, list[str]]], batch_sizes: list[int], corner: str = "batch size") -> Table:
    """The Ohio State layout: a header of batch sizes (``corner`` above the labels), then one labelled row each
    (``rows``: (label, one cell per batch size))."""
    right: tuple[Align, ...] = tuple("right" for _ in batch_sizes)
    align: tuple[Align, ...] = ("left", *right)
    return Table((corner, *map(str, batch_sizes)), tuple((label, *cells) for label, cells in rows), align)


def simple_table(header: list[str], rows: list[list[str]], align: str = "", classes: list[str] | None = None) -> Table:
    """A table from lists; ``align`` one letter per column (l or r, default every column left)."""
    aligns: tuple[Align, ...] = tuple("right" if a == "r" else "left" for a in (align or "l" * len(header)))
    return Table(tuple(header), tuple(tuple(r) for r in rows), aligns, tuple(classes or ()))


def _cell(text: str) -> str:
    return text.replace("|", "/")


def block_markdown(block: Block) -> list[str]:
    """One block as Markdown lines."""
    if isinstance(block, Paragraph):
        return [block.text]
    if isinstance(block, Lines):
        return list(block.lines)
    if isinstance(block, BulletList):
        return [f"- {item}" for item in block.items]
    if isinstance(block, Images):
        return [f"![{alt}]({path})" for alt, path in block.images]
    rule = ["---:" if a == "right" else "---" for a in block.align]
    return ["| " + " | ".join(_cell(c) for c in row) + " |" for row in (block.header, rule, *block.rows)]


def section_markdown(section: Section) -> list[str]:
    """One section as Markdown lines: its heading, then each block, each followed by a blank line."""
    lines = [f"{'#' * section.level} {section.title}", ""]
    for block in section.blocks:
        lines += block_markdown(block) + [""]
    return lines


def to_markdown(sections: list[Section]) -> str:
    """The sections as one Markdown document (report.md)."""
    return "\n".join(line for section in sections for line in section_markdown(section))
