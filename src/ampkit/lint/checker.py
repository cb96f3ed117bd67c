"""Run the rules over files: discovery, code selection, ``--fix`` and the atomic rewrite.

One file's source is linted by ``ampkit.lint.source``; this module reads the files, applies
``ampkit.lint.fix`` to them and writes them back.
"""

from __future__ import annotations

import codecs
import fnmatch
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ampkit._util.io import atomic_write_bytes
from ampkit.lint.astutil import source_lines
from ampkit.lint.core import SYNTAX_ERROR, Violation
from ampkit.lint.fix import apply_fixes
from ampkit.lint.notebook import NotebookError, lint_notebook
from ampkit.lint.source import ALL_CODES, check_source, unparsable

__all__ = [
    "SKIPPED_DIRS",
    "FileChangedError",
    "LintReport",
    "iter_python_files",
    "lint_file",
    "lint_paths",
    "parse_codes",
]

SKIPPED_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "site-packages", ".tox", ".nox",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules", ".eggs",
})
"""Directory names never descended into (a directory holding ``pyvenv.cfg`` is skipped too)."""

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
    unwritten: list[str] = field(default_factory=list)
    """``--fix`` rewrites that could not be saved (``"path: reason"``); those files are unchanged."""
    errors: list[str] = field(default_factory=list)
    """Paths that were not (fully) checked, ``"path: reason"``: a directory that cannot be listed, a
    notebook that is not valid JSON, a file edited while ``--fix`` rewrote it, a file the linter
    failed on.  The rest of the run is unaffected; the CLI prints them and exits 2."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know that are not errors (``--fix`` leaves notebooks alone)."""


class FileChangedError(Exception):
    """``--fix`` found the file changed since it was read; nothing was written."""


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


def lint_file(path: str, codes: frozenset[str] = ALL_CODES, fix: bool = False) -> tuple[list[Violation], int, int]:
    """Lint (and with ``fix`` rewrite) one file: (violations, fixes applied, lines).

    Raises ``OSError`` (naming the file and the cause) when a fix cannot be written, and
    ``FileChangedError`` when the file changed between reading it and replacing it (an editor
    saved it meanwhile); the file then holds what is there now, untouched by the fix.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read()
            before = os.fstat(handle.fileno())
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return unparsable(path, f"cannot read the file ({reason})", 1, 1, codes), 0, 0
    breaks = source_lines(data)
    lines = len(breaks) - (1 if breaks[-1] == b"" else 0)
    try:
        violations, ctx = check_source(data, path, codes)
        fixed = 0
        if fix and ctx is not None and any(v.code == "AMP101" for v in violations):
            new_data, fixed = apply_fixes(ctx, violations)
            if fixed:
                if data.startswith(codecs.BOM_UTF8):
                    new_data = codecs.BOM_UTF8 + new_data
                _write_source(path, new_data, data, before)
                violations, _ = check_source(new_data, path, codes)
    except RecursionError:
        return unparsable(path, "nesting too deep to analyse", 1, 1, codes), 0, lines
    return violations, fixed, lines


def _write_source(path: str, data: bytes, read: bytes, before: os.stat_result) -> None:
    """Replace a source file atomically (temp file, fsync, rename), through symlinks, keeping its
    mode; unless it no longer holds ``read`` (its size, mtime and bytes are compared again just
    before the rename).  What remains is the instant between that check and the rename."""
    target = os.path.realpath(path)

    def unchanged() -> None:
        try:
            now = os.stat(target)
            with open(target, "rb") as handle:
                current = handle.read()
        except OSError as exc:
            raise FileChangedError(f"{path}: the file changed during --fix (it cannot be read again: "
                                   f"{exc.strerror or exc}); it was not rewritten, run again") from exc
        if (now.st_size, now.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or current != read:
            raise FileChangedError(f"{path}: the file changed during --fix, so the fix was not written "
                                   "(the new content is kept); run `ampkit lint --fix` again")

    atomic_write_bytes(target, data, mode=os.stat(target).st_mode & 0o7777, check=unchanged)


def lint_paths(paths: Sequence[str], codes: frozenset[str] = ALL_CODES, exclude: Sequence[str] = (),
               fix: bool = False) -> LintReport:
    """Lint files and directories (recursively, skipping virtualenvs and caches).

    One file's trouble never stops the run: it is recorded in ``errors`` (or ``unwritten``) and
    the other files are checked as usual."""
    report = LintReport()
    for path in iter_python_files(paths, exclude, report.errors):
        try:
            if path.endswith(".ipynb"):
                violations, lines, note = lint_notebook(path, codes, fix)
                fixed = 0
                if note:
                    report.notes.append(note)
            else:
                violations, fixed, lines = _lint_one(path, codes, fix, report)
        except NotebookError as exc:
            report.errors.append(str(exc))
            continue
        except Exception as exc:  # a linter bug on one file must not cost the other files their check
            report.errors.append(f"{path}: the linter failed on this file and did not check it "
                                 f"({type(exc).__name__}: {exc}); please report it with the file")
            continue
        report.violations.extend(violations)
        report.fixed += fixed
        report.lines += lines
        report.files += 1
    return report


def _lint_one(path: str, codes: frozenset[str], fix: bool, report: LintReport) -> tuple[list[Violation], int, int]:
    try:
        return lint_file(path, codes, fix)
    except FileChangedError as exc:
        report.errors.append(str(exc))
    except OSError as exc:  # only the --fix write can raise: reading errors become AMP000
        report.unwritten.append(f"{path}: {exc}")
    return lint_file(path, codes, fix=False)


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


def iter_python_files(paths: Sequence[str], exclude: Sequence[str] = (),
                      errors: list[str] | None = None) -> Iterator[str]:
    """Python files under ``paths`` in sorted order.  Files named explicitly are always included
    unless an ``exclude`` pattern matches them (even a pipe such as ``/dev/stdin``); directories
    contribute their ``*.py`` regular files (FIFOs, sockets, devices and broken links are skipped).

    A directory that cannot be listed (no permission, a symlink loop, an I/O error) is skipped and
    named in ``errors`` as ``"path: cannot read the directory (reason)"``, so an unreadable part of
    a tree is never mistaken for a clean one."""
    patterns = _compile_excludes(exclude)

    def unreadable(exc: OSError) -> None:
        if errors is not None:
            errors.append(f"{exc.filename}: cannot read the directory ({exc.strerror or exc}); "
                          "its files were not checked")

    for root in paths:
        if not os.path.isdir(root):
            if not _excluded(os.path.normpath(root).replace(os.sep, "/"), False, patterns):
                yield root
            continue
        for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
            rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = sorted(
                d for d in dirnames
                if d not in SKIPPED_DIRS
                and not _excluded(rel_dir + d, True, patterns)
                and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))
            )
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                # Regular files only (through symlinks): opening a FIFO named *.py blocks until
                # someone writes to it, a device may never end.  Costs one stat per *.py file.
                if (name.endswith(".py") and not _excluded(rel_dir + name, False, patterns)
                        and os.path.isfile(full)):
                    yield os.path.normpath(full)
