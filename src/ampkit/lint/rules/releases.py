"""Which torch releases reach a line: old-release fallbacks and the branches of torch-version checks.

A rule about an API that gained an argument in some release (``torch.load(weights_only=)`` in 1.13,
``torch.is_autocast_enabled(device)`` in 2.4) must not report the argument-less call where only
releases without the argument run it: there it is the only spelling there is.  Unlike AMP101's
broader test (any version check, any ``except``), this one follows the direction of the check, so
``torch.load(p) if TORCH_GE_2_3 else ...`` (new releases) and the code after
``if not TORCH_GE_2_3: raise`` are still judged.

>>> import ast
>>> from ampkit.lint.rules.releases import implies_older
>>> implies_older(ast.parse("digit_version(TORCH_VERSION) < digit_version('1.7.0')", mode="eval").body, False)
(1, 7, 0)
>>> implies_older(ast.parse("not _TORCH_GREATER_EQUAL_2_3", mode="eval").body, False)
(2, 3)
>>> implies_older(ast.parse("_TORCH_GREATER_EQUAL_2_3", mode="eval").body, False) is None
True
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Callable

from ampkit.lint.astutil import last_name, name_or_str
from ampkit.lint.context import FileContext

__all__ = ["before_release", "implies_older", "project_torch_floor"]

Release = tuple[int, ...]
_FEATURE: Release = ()  # hasattr(torch.x, ...): a release older than the feature, which one unknown
_OLD_RELEASE_ERRORS = frozenset({"TypeError", "AttributeError"})  # what an old torch raises for new API
# _TORCH_GREATER_EQUAL_2_3, TORCH_GE_1_13, TORCH_2_4, torch_lt_2_0 ...
_FLAG = re.compile(r"torch_?(?:(greater|ge|gt|less|lt|le)[a-z_]*?_)?(\d+)_(\d+)", re.IGNORECASE)
_FLIP = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}
_NEGATE = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt}


def before_release(ctx: FileContext, node: ast.AST, release: Release, tried: Callable[[ast.Call], bool]) -> bool:
    """True when only torch releases older than ``release`` reach ``node``: the ``except TypeError``
    / ``AttributeError`` fallback of a ``try`` that makes a call ``tried`` accepts (the current
    spelling), a branch of a torch-version check taken only below ``release``, or the statements
    after ``if <torch >= release>: return/raise``.  An ``except UnpicklingError`` retry after a
    refused ``weights_only=True`` load is not such a fallback."""
    parents = ctx.parents
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.ExceptHandler) and _old_release_handler(ctx, parent, tried):
            return True
        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
            in_body = child is parent.body or (isinstance(parent.body, list) and any(s is child for s in parent.body))
            if _older(parent.test, not in_body, release):
                return True
        if isinstance(child, ast.stmt) and any(_older(before.test, True, release)
                                               for before in _exits_before(parent, child)):
            return True
        child, parent = parent, parents.get(id(parent))
    return False


# Where a project declares what it installs; a directory holding one of _ROOT_MARKERS (or .git) is
# the project's root, where the search upwards stops.
_MANIFESTS = ("pyproject.toml", "setup.py", "setup.cfg", "requirements.txt")
_ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
# torch>=2.6, torch == 2.8.0, "torch ~= 2.7": not torchvision, not pytorch-lightning.
_TORCH_PIN = re.compile(r"(?<![\w.-])torch(?:\[[^\]]*\])?\s*(>=|==|~=|>)\s*(\d+)\.(\d+)")


def project_torch_floor(path: str) -> Release | None:
    """The oldest torch release the project holding ``path`` declares it runs on: the lowest
    ``torch>=X.Y`` (``==``, ``~=``, ``>``) of the nearest manifest that names one, searching from
    the file's directory up to the project's root (a directory with ``pyproject.toml``,
    ``setup.py``, ``setup.cfg`` or ``.git``), never into an installed environment.  None when
    none is declared or ``path`` is not a file on disk (a snippet, stdin)."""
    if not os.path.isfile(path):
        return None
    return _floor_from(os.path.dirname(os.path.abspath(path)))


@functools.lru_cache(maxsize=1024)
def _floor_from(directory: str) -> Release | None:
    if os.path.basename(directory) in ("site-packages", "dist-packages") \
            or os.path.exists(os.path.join(directory, "pyvenv.cfg")):
        return None
    for name in _MANIFESTS:
        try:
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as handle:
                text = handle.read(1 << 20)
        except OSError:
            continue
        floors = [(int(major), int(minor)) for _, major, minor in _TORCH_PIN.findall(text)]
        if floors:
            return min(floors)
    parent = os.path.dirname(directory)
    if parent == directory or any(os.path.exists(os.path.join(directory, m)) for m in _ROOT_MARKERS):
        return None
    return _floor_from(parent)


def implies_older(test: ast.expr, negated: bool) -> Release | None:
    """``B`` when ``test`` (``not test`` if ``negated``) holds only on torch releases older than
    ``B``; ``()`` for a failed feature check on torch (``not hasattr(torch.amp, ...)``); else None."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return implies_older(test.operand, not negated)
    if isinstance(test, ast.BoolOp):
        # `a and b` true, or `a or b` false, constrains the release through either operand.
        if isinstance(test.op, ast.And) != negated:
            return next((b for v in test.values if (b := implies_older(v, negated)) is not None), None)
        return None
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return _compare_older(test.left, type(test.ops[0]), test.comparators[0], negated)
    if isinstance(test, ast.Call) and last_name(test.func) == "hasattr" and test.args:
        return _FEATURE if negated and _mentions_torch(test.args[0]) else None
    match = _FLAG.search(name_or_str(test) or "") if isinstance(test, ast.Name | ast.Attribute) else None
    if match is None:
        return None
    flag_older = (match.group(1) or "ge").lower() in ("less", "lt", "le")
    bound: Release = (int(match.group(2)), int(match.group(3)))
    if (match.group(1) or "").lower() == "le":
        bound = (*bound, 1)  # torch <= 2.3 is torch < 2.3.1
    return bound if flag_older != negated else None


def _older(test: ast.expr, negated: bool, release: Release) -> bool:
    bound = implies_older(test, negated)
    return bound is not None and bound <= release


def _compare_older(left: ast.expr, op: type[ast.cmpop], right: ast.expr, negated: bool) -> Release | None:
    literal = _release_literal(right)
    if literal is None:
        literal, left, op = _release_literal(left), right, _FLIP.get(op, op)
    if literal is None or op not in _NEGATE or not _mentions_torch(left):
        return None
    if negated:
        op = _NEGATE[op]
    if op is ast.Lt:
        return literal
    if op is ast.LtE:
        return (*literal, 1)
    return None


def _release_literal(node: ast.expr) -> Release | None:
    # "1.7.0", (2, 4), version.parse("2.4"), digit_version('1.7.0'), LooseVersion("1.13")
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if isinstance(node, ast.Tuple) and node.elts:
        parts = [e.value for e in node.elts if isinstance(e, ast.Constant) and type(e.value) is int]
        return tuple(parts) if len(parts) == len(node.elts) else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"\d+(\.\d+)+", node.value):
        return tuple(int(part) for part in node.value.split("."))
    return None


def _mentions_torch(node: ast.expr) -> bool:
    return any("torch" in (name_or_str(n) or "").lower() for n in ast.walk(node))


def _exits_before(parent: ast.AST, stmt: ast.stmt) -> list[ast.If]:
    # `if <check>: return/raise` earlier in the same block: `stmt` runs only when <check> is false.
    for field in ("body", "orelse", "finalbody"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and any(s is stmt for s in block):
            earlier = block[: next(i for i, s in enumerate(block) if s is stmt)]
            return [s for s in earlier if isinstance(s, ast.If) and s.body
                    and isinstance(s.body[-1], (ast.Return, ast.Raise))]
    return []


def _old_release_handler(ctx: FileContext, handler: ast.ExceptHandler, tried: Callable[[ast.Call], bool]) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    if not any(last_name(t) in _OLD_RELEASE_ERRORS for t in caught if t is not None):
        return False
    body = getattr(ctx.parents.get(id(handler)), "body", [])  # an except's parent is a try (or try*)
    return any(isinstance(n, ast.Call) and tried(n) for stmt in body for n in ast.walk(stmt))
