"""Tests of ``ampkit.lint.rules``: one file per rule module, for the decisions the golden fixtures
(tests/lint/fixtures) do not spell out."""

from __future__ import annotations

from ampkit.lint import lint_source


def hits(source: str) -> list[tuple[int, str]]:
    """The ``(line, code)`` of each violation all rules find in ``source``."""
    return [(v.line, v.code) for v in lint_source(source)]
