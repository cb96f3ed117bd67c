"""docs/lint.md and the rule catalog describe every rule the linter has."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import ampkit.lint.rules
from ampkit.lint import RULES

DOCS = Path(__file__).parents[2] / "docs" / "lint.md"


def test_docs_every_rule_has_its_section_in_lint_md() -> None:
    sections = set(re.findall(r"^### (AMP\d{3}) — ", DOCS.read_text(), re.MULTILINE))
    assert sorted(r.code for r in RULES if r.code not in sections) == []


def test_docs_rule_catalog_table_lists_every_rule() -> None:
    listed = set(re.findall(r"^\| (AMP\d{3}) \|", ampkit.lint.rules.__doc__ or "", re.MULTILINE))
    assert listed == {r.code for r in RULES}


def test_docs_code_layout_names_the_rule_file_of_every_rule() -> None:
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `rules/` |"))
    files = [info.name for info in pkgutil.iter_modules(ampkit.lint.rules.__path__)
             if hasattr(importlib.import_module(f"ampkit.lint.rules.{info.name}"), "RULES")]
    assert "fp8" in files
    assert [name for name in files if f"`{name}` (" not in row] == []
