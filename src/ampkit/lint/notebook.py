"""Lint a Jupyter notebook (``.ipynb``): its code cells, as the one module they run as.

The code cells are joined in file order, so a scaler built in one cell and stepped in another is
followed as in a script; each violation is mapped back to its cell and the line within it
(``nb.ipynb:cell 3:2:5: AMP102 ...``).  Cells are numbered from 1 among *all* the file's cells,
markdown and raw ones included, which is stable while the file is unchanged (Jupyter's execution
counts are not).

IPython syntax is not Python: a line magic (``%time x = f()``), a shell line (``!pip install``,
``files = !ls``) or a help line (``obj?``) is replaced by ``pass`` at its indentation, and a cell
magic (``%%bash``) cell is not linted; line numbers stay those of the cell.  ``--fix`` does not
rewrite notebooks (their JSON holds outputs and metadata the rewrite would have to keep): the
violations stay reported and a note says so.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ampkit.lint.core import Violation
from ampkit.lint.source import check_source

__all__ = ["NotebookError", "lint_notebook", "notebook_source"]

# A line that IPython, not Python, reads: magics, shell escapes (also `x = !cmd`), `obj?` help.
_IPYTHON_LINE = re.compile(r"^(\s*)(?:[%!]|[\w.]+\s*=\s*[%!]|\?|[\w.\[\]()]+\?\??\s*$)")


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class NotebookError(ValueError):
    """The file is not a notebook this linter can read (not JSON, or not nbformat's layout)."""


def notebook_source(document: Any, path: str) -> tuple[str, list[tuple[int, int]]]:
    """The Python source of the notebook's code cells and, for each, ``(cell number, first line)``
    in that source.  Raises ``NotebookError`` naming what is wrong.

    >>> nb = {"cells": [{"cell_type": "markdown", "source": "# t"},
    ...                 {"cell_type": "code", "source": ["!pip install x\\n", "import torch"]}]}
    >>> notebook_source(nb, "nb.ipynb")
    ('pass\\nimport torch\\n', [(2, 1)])
    """
    cells = document.get("cells") if isinstance(document, dict) else None
    if not isinstance(cells, list):
        raise NotebookError(f"{path}: not a Jupyter notebook (no \"cells\" list at the top of its JSON); "
                            "pass a .ipynb file written by Jupyter (nbformat 4)")
    parts: list[str] = []
    starts: list[tuple[int, int]] = []
    line = 1
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            raise NotebookError(f"{path}: cell {number} has a \"source\" that is neither a string nor a list "
                                "of strings; the notebook is malformed (re-save it in Jupyter)")
        # The tokenizer's line breaks only (str.splitlines also splits at \x0c, \x1c, U+2028...).
        lines = _LINE_BREAK.split(source)
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()
        if lines[0].lstrip().startswith("%%"):
            lines = [""] * len(lines)  # a cell magic: the cell is another language (bash, html, ...)
        starts.append((number, line))
        parts.extend(_python_line(text) for text in lines)
        line += len(lines)
    return "".join(text + "\n" for text in parts), starts


def _python_line(text: str) -> str:
    match = _IPYTHON_LINE.match(text)
    return text if match is None else match.group(1) + "pass"


def lint_notebook(path: str, codes: frozenset[str], fix: bool = False) -> tuple[list[Violation], int, str | None]:
    """Lint the code cells of the notebook at ``path``: (violations, lines, a note for the user or
    None).  Raises ``NotebookError`` for a file that is not valid notebook JSON."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read the notebook ({exc.strerror or exc})") from exc
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotebookError(f"{path}: not valid notebook JSON ({exc}); the file was not checked") from exc
    except RecursionError as exc:
        raise NotebookError(f"{path}: not a notebook (its JSON nests too deeply to read); the file was "
                            "not checked") from exc
    source, starts = notebook_source(document, path)
    found, _ = check_source(source.encode("utf-8"), path, codes)
    violations = [_in_cell(v, starts) for v in found]
    note = None
    if fix and any(v.code == "AMP101" for v in violations):
        note = f"{path}: --fix does not rewrite notebooks; its AMP101 uses stay reported, fix them in Jupyter"
    return violations, source.count("\n"), note


def _in_cell(v: Violation, starts: list[tuple[int, int]]) -> Violation:
    cell, first = 0, 1
    for number, line in starts:
        if line > v.line:
            break
        cell, first = number, line
    if not cell:  # no code cell at all (AMP000 of an empty source): the notebook as a whole
        return v
    return Violation(v.path, v.line - first + 1, v.col, v.code, v.message, cell)
