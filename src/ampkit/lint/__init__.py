"""``ampkit lint``: find AMP mistakes in source before they cost a training run.

An AST-based linter with one rule per mistake (AMP101–AMP116, see ``ampkit.lint.rules``), each
with a stable code and a message that names the fix.  It imports nothing it lints and runs at
parse speed: a rule's analysis runs only on files that contain its trigger words.

>>> from ampkit.lint import lint_source
>>> src = '''
... import torch
... scaler = torch.cuda.amp.GradScaler()
... '''
>>> [(v.line, v.col, v.code) for v in lint_source(src)]
[(3, 10, 'AMP101')]
"""

from __future__ import annotations

from ampkit.lint.checker import LintReport, iter_python_files, lint_file, lint_paths, parse_codes
from ampkit.lint.core import SYNTAX_ERROR, Rule, Violation
from ampkit.lint.rules import RULES, RULES_BY_CODE
from ampkit.lint.source import ALL_CODES, lint_source

__all__ = [
    "ALL_CODES",
    "RULES",
    "RULES_BY_CODE",
    "SYNTAX_ERROR",
    "LintReport",
    "Rule",
    "Violation",
    "iter_python_files",
    "lint_file",
    "lint_paths",
    "lint_source",
    "parse_codes",
]
