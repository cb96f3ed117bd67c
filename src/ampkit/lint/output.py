"""Render a ``LintReport`` as text, ``ampkit.lint/1`` JSON, or GitHub workflow annotations."""

from __future__ import annotations

import json

from ampkit.lint.checker import LintReport
from ampkit.lint.core import Violation

__all__ = ["FORMATS", "SCHEMA", "render", "summary"]

SCHEMA = "ampkit.lint/1"
FORMATS = ("text", "json", "github")


def render(report: LintReport, fmt: str) -> str:
    """The report in ``fmt`` (one of ``FORMATS``), ending with a newline unless empty.

    >>> r = LintReport([Violation("a.py", 2, 5, "AMP113", "pass weights_only=True")], files=1)
    >>> print(render(r, "text"), end="")
    a.py:2:5: AMP113 pass weights_only=True
    >>> print(render(r, "github"), end="")
    ::error file=a.py,line=2,col=5,title=AMP113::pass weights_only=True
    """
    if fmt == "json":
        document = {
            "schema": SCHEMA,
            "violations": [v.to_json() for v in report.violations],
            "files_checked": report.files,
            "fixed": report.fixed,
        }
        return json.dumps(document, indent=2) + "\n"
    if fmt == "github":
        return "".join(_annotation(v) + "\n" for v in report.violations)
    if fmt == "text":
        return "".join(f"{_plain_path(v.path)}:{v.where}: {v.code} {_plain(v.message)}\n"
                       for v in report.violations)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def summary(report: LintReport) -> str:
    """One human line for stderr."""
    fixed = f"; fixed {report.fixed}" if report.fixed else ""
    if not report.violations:
        return f"ampkit lint: {report.files} file(s) checked, no violations{fixed}"
    files = len({v.path for v in report.violations})
    return (f"ampkit lint: {len(report.violations)} violation(s) in {files} file(s), "
            f"{report.files} file(s) checked{fixed}")


def _plain(text: str) -> str:
    """``text`` on one line: control characters as backslash escapes, so a crafted file name cannot start
    a line of its own (a CI log reads a line that begins with ``::`` as a workflow command)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _plain_path(path: str) -> str:
    """``_plain``, and a path that itself begins with ``::`` shown as ``./::...`` (the same file)."""
    text = _plain(path)
    return f"./{text}" if text.startswith("::") else text


def _escape_data(text: str) -> str:
    # GitHub's workflow-command escaping (actions/toolkit, command.ts).
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _annotation(v: Violation) -> str:
    if v.cell:  # a line of the notebook's JSON would point at no code: a file annotation naming the cell
        return (f"::error file={_escape_property(v.path)},"
                f"title={_escape_property(f'{v.code} (cell {v.cell}, line {v.line})')}::{_escape_data(v.message)}")
    return (f"::error file={_escape_property(v.path)},line={v.line},col={v.col},"
            f"title={_escape_property(v.code)}::{_escape_data(v.message)}")
