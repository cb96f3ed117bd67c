"""Run the rules over files: discovery, parsing, ``# noqa``, code selection, ``--fix``.

Cost model: a file that contains some rule's trigger strings is parsed into an ``ast`` tree
(~150k lines/s on one core) and walked once; any other file is only syntax-checked with
``compile()`` (about twice as fast), so a large package costs little more than its parse.
"""

from __future__ import annotations

import ast
import codecs
import fnmatch
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ampkit.lint.context import FileContext
from ampkit.lint.core import SYNTAX_ERROR, Violation
from ampkit.lint.rules import RULES, RULES_BY_CODE

__all__ = [
    "ALL_CODES",
    "SKIPPED_DIRS",
    "LintReport",
    "iter_python_files",
    "lint_file",
    "lint_paths",
    "lint_source",
    "parse_codes",
]

ALL_CODES: frozenset[str] = frozenset({SYNTAX_ERROR, *RULES_BY_CODE})

SKIPPED_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "site-packages", ".tox", ".nox",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules", ".eggs",
})
"""Directory names never descended into (a directory holding ``pyvenv.cfg`` is skipped too)."""

# flake8's syntax: a bare noqa comment silences every code on its line, "noqa: AMP102, AMP105" only those.
_NOQA = re.compile(rb"#\s*noqa(?::\s*(?P<codes>[A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*))?", re.IGNORECASE)


@dataclass(slots=True)
class LintReport:
    """The outcome of linting a set of paths."""

    violations: list[Violation] = field(default_factory=list)
    files: int = 0
    """Files checked."""
    lines: int = 0
    """Source lines checked (for throughput figures)."""
    fixed: int = 0
    """Violations removed by ``--fix``."""


def parse_codes(select: str | Sequence[str] | None, ignore: str | Sequence[str] | None) -> frozenset[str]:
    """The codes to report for ``--select`` / ``--ignore`` (comma-separated codes or prefixes).

    A prefix selects every code it starts (``AMP10`` is AMP101–AMP109); ``ALL`` selects all.
    Raises ``ValueError`` naming the unknown code and the valid ones.

    >>> sorted(parse_codes("AMP101,AMP113", None))
    ['AMP000', 'AMP101', 'AMP113']
    >>> "AMP105" in parse_codes(None, "AMP105")
    False
    """
    chosen = set(ALL_CODES) if not select else {SYNTAX_ERROR, *_expand(select)}
    if ignore:
        chosen -= _expand(ignore)
    return frozenset(chosen)


def _expand(spec: str | Sequence[str]) -> set[str]:
    items = [spec] if isinstance(spec, str) else list(spec)
    codes: set[str] = set()
    for item in items:
        for token in filter(None, (t.strip().upper() for t in item.split(","))):
            if token == "ALL":
                codes |= ALL_CODES
                continue
            matched = {code for code in ALL_CODES if code.startswith(token)}
            if not matched:
                raise ValueError(f"unknown rule code {token!r}; valid codes are {', '.join(sorted(ALL_CODES))} "
                                 "(or a prefix such as AMP1, or ALL)")
            codes |= matched
    return codes


def lint_source(source: bytes | str, path: str = "<string>", codes: Iterable[str] | None = None) -> list[Violation]:
    """Lint one file's source; violations sorted by position, ``# noqa`` applied.

    >>> [v.code for v in lint_source("import torch\\nstate = torch.load('ckpt.pt')\\n")]
    ['AMP113']
    >>> lint_source("import torch\\nstate = torch.load('ckpt.pt')  # noqa: AMP113\\n")
    []
    """
    data = source.encode("utf-8") if isinstance(source, str) else source
    return _lint(data, path, frozenset(codes) if codes is not None else ALL_CODES)[0]


def _lint(data: bytes, path: str, codes: frozenset[str]) -> tuple[list[Violation], FileContext | None]:
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
        return _unparsable(path, exc.msg, exc.lineno or 1, exc.offset or 1, codes), None
    except ValueError as exc:  # null bytes (a SyntaxError from Python 3.12 on)
        return _unparsable(path, str(exc), 1, 1, codes), None
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


def _unparsable(path: str, reason: str, line: int, col: int, codes: frozenset[str]) -> list[Violation]:
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


def lint_file(path: str, codes: frozenset[str] = ALL_CODES, fix: bool = False) -> tuple[list[Violation], int, int]:
    """Lint (and with ``fix`` rewrite) one file: (violations, fixes applied, lines)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return _unparsable(path, f"cannot read the file ({reason})", 1, 1, codes), 0, 0
    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    try:
        violations, ctx = _lint(data, path, codes)
        fixed = 0
        if fix and ctx is not None and any(v.code == "AMP101" for v in violations):
            from ampkit.lint.fix import apply_fixes

            new_data, fixed = apply_fixes(ctx, violations)
            if fixed:
                if data.startswith(codecs.BOM_UTF8):
                    new_data = codecs.BOM_UTF8 + new_data
                _write_source(path, new_data)
                violations, _ = _lint(new_data, path, codes)
    except RecursionError:
        return _unparsable(path, "nesting too deep to analyse", 1, 1, codes), 0, lines
    return violations, fixed, lines


def _write_source(path: str, data: bytes) -> None:
    """Replace a source file atomically (temp file, fsync, rename), through symlinks, keeping its mode."""
    from ampkit._util.io import atomic_write_bytes

    target = os.path.realpath(path)
    mode = os.stat(target).st_mode & 0o7777
    atomic_write_bytes(target, data)
    # The temporary file is created 0600; until this chmod the file is only stricter, never wider.
    os.chmod(target, mode)


def lint_paths(paths: Sequence[str], codes: frozenset[str] = ALL_CODES, exclude: Sequence[str] = (),
               fix: bool = False) -> LintReport:
    """Lint files and directories (recursively, skipping virtualenvs and caches)."""
    report = LintReport()
    for path in iter_python_files(paths, exclude):
        violations, fixed, lines = lint_file(path, codes, fix)
        report.violations.extend(violations)
        report.fixed += fixed
        report.lines += lines
        report.files += 1
    return report


def _compile_excludes(patterns: Sequence[str]) -> list[tuple[str, bool, bool]]:
    compiled = []
    for raw in patterns:
        for pattern in filter(None, (p.strip() for p in raw.split(","))):
            dir_only = pattern.endswith("/")
            pattern = pattern.strip("/")
            anchored = "/" in pattern
            compiled.append((pattern, anchored, dir_only))
    return compiled


def _excluded(rel: str, is_dir: bool, patterns: list[tuple[str, bool, bool]]) -> bool:
    # .gitignore-like: a pattern without "/" matches a name at any depth, one with "/" matches the
    # path relative to the linted root; a trailing "/" restricts it to directories.
    name = rel.rpartition("/")[2]
    for pattern, anchored, dir_only in patterns:
        if dir_only and not is_dir:
            continue
        if fnmatch.fnmatchcase(rel if anchored else name, pattern):
            return True
    return False


def iter_python_files(paths: Sequence[str], exclude: Sequence[str] = ()) -> Iterator[str]:
    """Python files under ``paths`` in sorted order.  Files named explicitly are always included
    unless an ``exclude`` pattern matches them; directories contribute their ``*.py`` files."""
    patterns = _compile_excludes(exclude)
    for root in paths:
        if not os.path.isdir(root):
            if not _excluded(os.path.normpath(root).replace(os.sep, "/"), False, patterns):
                yield root
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = sorted(
                d for d in dirnames
                if d not in SKIPPED_DIRS
                and not _excluded(rel_dir + d, True, patterns)
                and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))
            )
            for name in sorted(filenames):
                if name.endswith(".py") and not _excluded(rel_dir + name, False, patterns):
                    yield os.path.normpath(os.path.join(dirpath, name))
