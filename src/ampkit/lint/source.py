"""Lint one file's source: screen, parse, run the wanted rules, apply ``# noqa``.

This is the bottom of the linter's pipeline: ``checker`` (files, ``--fix``) and ``fix`` (the
AMP101 rewrite) both build on it, and it imports neither.

Cost model: a file that contains some rule's trigger strings is parsed into an ``ast`` tree
(~150k lines/s on one core) and walked once; any other file is only syntax-checked with
``compile()`` (about twice as fast), so a large package costs little more than its parse.
"""

from __future__ import annotations

import ast
import codecs
import re
import warnings
from collections.abc import Iterable

from ampkit.lint.context import FileContext
from ampkit.lint.core import SYNTAX_ERROR, Violation
from ampkit.lint.rules import RULES, RULES_BY_CODE

__all__ = ["ALL_CODES", "check_source", "lint_source", "unparsable"]

ALL_CODES: frozenset[str] = frozenset({SYNTAX_ERROR, *RULES_BY_CODE})

# flake8's syntax: a bare noqa comment silences every code on its line, "noqa: AMP102, AMP105" only those.
_NOQA = re.compile(rb"#\s*noqa(?::\s*(?P<codes>[A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*))?", re.IGNORECASE)


def lint_source(source: bytes | str, path: str = "<string>", codes: Iterable[str] | None = None) -> list[Violation]:
    """Lint one file's source; violations sorted by position, ``# noqa`` applied.

    >>> [v.code for v in lint_source("import torch\\nstate = torch.load('ckpt.pt')\\n")]
    ['AMP113']
    >>> lint_source("import torch\\nstate = torch.load('ckpt.pt')  # noqa: AMP113\\n")
    []
    """
    data = source.encode("utf-8") if isinstance(source, str) else source
    return check_source(data, path, frozenset(codes) if codes is not None else ALL_CODES)[0]


def check_source(data: bytes, path: str, codes: frozenset[str]) -> tuple[list[Violation], FileContext | None]:
    """The violations of ``data`` and, when it was parsed and some rule ran, its ``FileContext``
    (``--fix`` edits from the same tree the violations were found in).

    >>> violations, ctx = check_source(b"x = 1\\n", "a.py", ALL_CODES)
    >>> violations, ctx is None
    ([], True)
    """
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    seen: dict[bytes | re.Pattern[bytes], bool] = {}
    rules = [r for r in RULES if r.code in codes and r.wanted(data, seen)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. are not our business
            if not rules and _compiles(data, path):
                return [], None
            tree = ast.parse(data, filename=path)
    except SyntaxError as exc:
        return unparsable(path, exc.msg, exc.lineno or 1, exc.offset or 1, codes), None
    except ValueError as exc:  # null bytes (a SyntaxError from Python 3.12 on)
        return unparsable(path, str(exc), 1, 1, codes), None
    if not rules:
        return [], None  # it parses; compile() refused it later (`return` outside a function): not AMP000
    ctx = FileContext(path, data, tree)
    found: dict[tuple[int, int, str], Violation] = {}
    for rule in rules:
        for node, message in rule.check(ctx):
            line, col = ctx.position(node)
            if _silenced(ctx, node, line, rule.code):
                continue
            found.setdefault((line, col, rule.code), Violation(path, line, col, rule.code, message))
    return sorted(found.values()), ctx


def _compiles(data: bytes, path: str) -> bool:
    """Syntax check for files no rule looks at: compile() skips building a Python object per AST
    node and is ~2x faster than ast.parse.  On failure the caller re-parses with ast.parse, so
    AMP000 means "does not parse" whichever way a file was checked."""
    try:
        compile(data, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def unparsable(path: str, reason: str, line: int, col: int, codes: frozenset[str]) -> list[Violation]:
    """The ``AMP000`` record for a file that was not checked (empty when AMP000 is not selected).

    >>> unparsable("a.py", "invalid syntax", 3, 0, ALL_CODES)[0].col
    1
    """
    if SYNTAX_ERROR not in codes:
        return []
    return [Violation(path, line, max(col, 1), SYNTAX_ERROR, f"syntax error: {reason}; the file was not checked")]


def _silenced(ctx: FileContext, node: ast.AST, line: int, code: str) -> bool:
    # The comment may sit on the reported line or, for a call spread over lines, on its last line.
    lines = {line}
    if isinstance(node, ast.expr) and node.end_lineno is not None:
        lines.add(node.end_lineno)
    for number in lines:
        if not 0 < number <= len(ctx.lines):
            continue
        text = ctx.lines[number - 1]
        if b"#" not in text:
            continue
        for match in _NOQA.finditer(text):
            listed = match.group("codes")
            if listed is None:
                return True
            if code.encode() in re.split(rb"[\s,]+", listed.upper()):
                return True
    return False
