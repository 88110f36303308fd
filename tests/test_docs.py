"""The documentation: the MkDocs site builds with warnings as errors (what `make docs` and CI run), the README stays
short, every relative link in the README and docs/ leads to a file, and the generated reference covers the code."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_LIMIT_BYTES = 10 * 1024
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300, env=env)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)   # links inside code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target for target in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", target)]


def test_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    # the generated reference pages hold the generated tables, not the bare marker
    for page, expected in [("reference/spec.html", "warmup_steps"), ("reference/cli.html", "harness max-batch"),
                           ("reference/results.html", "throughput_samples_per_s")]:
        html = (site / page).read_text()
        assert "generated:" not in html, page
        assert expected in html, (page, expected)
    assert (site / "report-html.png").is_file()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The strict build is a real check: the same site with one link to a missing page does not build."""
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "results").mkdir()
    shutil.copy(ROOT / "results" / "README.md", copy / "results" / "README.md")
    page = copy / "docs" / "guide" / "specs.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](not-there.md).\n")
    result = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "not-there.md" in result.stdout + result.stderr


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT_BYTES, (f"README.md is {size} bytes; the limit is {README_LIMIT_BYTES}: "
                                        "move text to docs/")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(path: Path) -> None:
    missing = []
    for target in _relative_links(path):
        file_part = target.split("#", 1)[0]
        if file_part and not (path.parent / file_part).resolve().exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_link_check_finds_a_missing_file(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](gone.md#x) [web](https://example.org) [here](#top) `[code](no.md)`\n")
    assert _relative_links(page) == ["page.md", "gone.md#x"]


def test_generated_reference_covers_the_code() -> None:
    from harness.results.schema import TrialRecord
    from harness.spec import Spec

    hooks = _hooks()
    spec_page = hooks.spec_reference()
    for model in hooks._models_from(Spec):
        assert f"### {model.__name__} " in spec_page
        for name in model.model_fields:
            assert f"| `{name}` |" in spec_page, (model.__name__, name)
    cli_page = hooks.cli_reference()
    for name, _, sub in hooks._subcommands(hooks._build_parser()):
        assert f"### harness {name} " in cli_page
        for action in sub._actions:
            for option in action.option_strings if action.dest != "help" else ():
                assert f"`{option}`" in cli_page, (name, option)
    results_page = hooks.results_reference()
    for name in TrialRecord.model_json_schema()["properties"]:
        assert f"| `{name}` |" in results_page, name
    assert hooks.render("<!-- generated: spec -->") == spec_page
    with pytest.raises(KeyError):
        hooks.render("<!-- generated: nothing -->")


def test_module_docstrings_link_to_pages_that_exist() -> None:
    """A module that moved its design notes to docs/ names the page; the page must exist."""
    named = 0
    for module in sorted((ROOT / "harness").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(module.read_text())) or ""
        for page in re.findall(r"docs/[\w/.-]+\.md", doc):
            named += 1
            assert (ROOT / page).is_file(), f"{module.relative_to(ROOT)} names {page}, which does not exist"
    assert named >= 5
