"""The linter's vocabulary: a ``Violation`` (one finding at one place) and a ``Rule``.

A rule is a plain function from a parsed file to ``(node, message)`` pairs, wrapped with its
stable code, a short name, a one-line summary, and the byte strings the file must contain for
the rule to be worth running.  The substring screen is what keeps ``ampkit lint`` fast on large
trees: most files of a big package never reach the rule's AST pass at all.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampkit.lint.context import FileContext

__all__ = ["SYNTAX_ERROR", "Hit", "Rule", "Violation", "rule"]

SYNTAX_ERROR = "AMP000"
"""Code of the record emitted for a file that cannot be parsed (or read); it is never silenced by
``--select``, only by ``--ignore AMP000``."""

Hit = tuple[ast.AST, str]
"""What a rule's check yields: the node to point at and the message."""


@dataclass(frozen=True, order=True, slots=True)
class Violation:
    """One finding.  ``line`` and ``col`` are 1-based; ``col`` counts characters, not bytes.

    >>> v = Violation(path="train.py", line=3, col=5, code="AMP113", message="use weights_only=True")
    >>> v.to_json()["code"], str(v)
    ('AMP113', 'train.py:3:5: AMP113 use weights_only=True')
    """

    path: str
    line: int
    col: int
    code: str
    message: str
    cell: int = 0
    """In a notebook: the 1-based index of the cell among all the file's cells (markdown ones
    counted), with ``line`` counted within the cell; 0 for a Python file."""

    def to_json(self) -> dict[str, Any]:
        """The ``ampkit.lint/1`` record (``cell`` only for a notebook)."""
        record: dict[str, Any] = {"code": self.code, "path": self.path, "line": self.line, "col": self.col,
                                  "message": self.message}
        if self.cell:
            record["cell"] = self.cell
        return record

    @property
    def where(self) -> str:
        """``line:col``, or ``cell N:line:col`` in a notebook."""
        return f"cell {self.cell}:{self.line}:{self.col}" if self.cell else f"{self.line}:{self.col}"

    def __str__(self) -> str:
        return f"{self.path}:{self.where}: {self.code} {self.message}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """A lint rule: a stable code and the check that finds it."""

    code: str
    """Stable identifier, ``AMPnnn``; never reused for another meaning."""
    name: str
    """Short kebab-case name, used in the documentation."""
    summary: str
    """One line: what is wrong."""
    needs: tuple[tuple[bytes | re.Pattern[bytes], ...], ...]
    """Screen on the raw file: every group must have at least one of its strings (or patterns) in it."""
    check: Callable[[FileContext], Iterable[Hit]]
    """The check itself; it yields ``(node, message)`` for each violation."""

    def wanted(self, source: bytes, seen: dict[bytes | re.Pattern[bytes], bool] | None = None) -> bool:
        """True when ``source`` passes the substring screen (a necessary, not sufficient, condition).

        ``seen`` caches each token's answer across the rules screening the same file.
        """
        cache: dict[bytes | re.Pattern[bytes], bool] = {} if seen is None else seen
        for group in self.needs:
            for token in group:
                found = cache.get(token)
                if found is None:
                    found = (token.search(source) is not None) if isinstance(token, re.Pattern) else token in source
                    cache[token] = found
                if found:
                    break
            else:
                return False
        return True


def rule(*, code: str, name: str, summary: str,
         needs: tuple[tuple[str | re.Pattern[bytes], ...], ...]) -> Callable[[Callable[[FileContext], Iterable[Hit]]], Rule]:
    """Decorator turning a check function into a ``Rule``."""

    def wrap(check: Callable[[FileContext], Iterable[Hit]]) -> Rule:
        encoded = tuple(tuple(token.encode() if isinstance(token, str) else token for token in group)
                        for group in needs)
        return Rule(code=code, name=name, summary=summary, needs=encoded, check=check)

    return wrap
