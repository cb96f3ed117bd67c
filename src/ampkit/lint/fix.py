"""``ampkit lint --fix``: rewrite the deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` API (AMP101).

=====================================================  ==========================================================
before                                                 after
=====================================================  ==========================================================
``torch.cuda.amp.autocast(True, torch.bfloat16)``      ``torch.amp.autocast("cuda", enabled=True, dtype=torch.bfloat16)``
``torch.cuda.amp.GradScaler(init_scale=1024)``         ``torch.amp.GradScaler("cuda", init_scale=1024)``
``@torch.cuda.amp.custom_fwd``                         ``@torch.amp.custom_fwd(device_type="cuda")``
``@torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)``  ``@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)``
``from torch.cuda.amp import autocast`` + ``autocast()``   ``from torch.amp import autocast`` + ``autocast("cuda")``
``from torch.cuda import amp`` + ``amp.GradScaler()``      ``from torch import amp`` + ``amp.GradScaler("cuda")``
=====================================================  ==========================================================

Positional arguments of the legacy ``autocast(enabled, dtype, cache_enabled)`` become keywords,
because ``torch.amp.autocast`` takes ``(device_type, dtype, enabled, ...)``: inserting the device
alone would silently turn ``enabled`` into ``dtype``.

A use is rewritten only when the rewrite is certain: an imported name (or module alias) is
rewritten only when *every* use of it in the file is a reported, rewritable call, because the
import itself changes.  Anything else stays reported and untouched.  Edits are computed on the
original bytes from AST positions, must not overlap, and the result must parse, or the file is
left as it was.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import defaultdict

from ampkit.lint.astutil import line_starts
from ampkit.lint.context import FileContext
from ampkit.lint.core import Violation
from ampkit.lint.rules.api import DEPRECATED, deprecated_references
from ampkit.lint.source import check_source

__all__ = ["apply_fixes", "fix_source"]

Edit = tuple[int, int, bytes]
_LEGACY_AUTOCAST_ARGS = ("enabled", "dtype", "cache_enabled")
_FIXABLE = {"cuda": frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"}),
            "cpu": frozenset({"autocast", "GradScaler"})}
_LEGACY_MODULES = {f"torch.{device}.amp": device for device in _FIXABLE}


def fix_source(source: str) -> tuple[str, int]:
    """Rewrite the AMP101 uses of ``source``; returns the new source and the number of uses fixed.

    >>> new, count = fix_source("import torch\\nscaler = torch.cuda.amp.GradScaler()\\n")
    >>> print(new, count)
    import torch
    scaler = torch.amp.GradScaler("cuda")
     1
    """
    violations, ctx = check_source(source.encode("utf-8"), "<string>", frozenset({"AMP101"}))
    if ctx is None:
        return source, 0
    data, count = apply_fixes(ctx, violations)
    return data.decode("utf-8"), count


class _Source:
    """Byte offsets of AST positions (ast columns are UTF-8 byte offsets)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.starts = line_starts(data)  # \r and \r\n end lines too: a CR-only file is one "\n" line

    def start(self, node: ast.AST) -> int:
        return self.starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]

    def after_open_paren(self, call: ast.Call) -> int:
        return self.data.index(b"(", self.end(call.func)) + 1


def apply_fixes(ctx: FileContext, violations: list[Violation]) -> tuple[bytes, int]:
    """Fix the reported (not ``# noqa``-silenced) AMP101 violations of ``ctx``'s file."""
    wanted = {(v.line, v.col) for v in violations if v.code == "AMP101"}
    if not wanted:
        return ctx.source, 0
    src = _Source(ctx.source)
    edits: list[Edit] = []
    fixed: set[int] = set()
    by_local: dict[str, list[tuple[ast.expr, str, ast.AST]]] = defaultdict(list)
    for ref, name, user in deprecated_references(ctx):
        if ctx.position(ref) not in wanted:
            continue
        if isinstance(ref, ast.Attribute) and _torch_chain(ctx, ref.value):
            call_edits = _call_edits(src, name, user, ref)
            if call_edits is not None:
                # torch.cuda.amp.X -> torch.amp.X: ".cuda.amp" becomes ".amp"
                base = ref.value.value.value  # type: ignore[attr-defined]
                edits.append((src.end(base), src.end(ref.value), b".amp"))
                edits.extend(call_edits)
                fixed.add(id(ref))
            continue
        root = ref.value if isinstance(ref, ast.Attribute) else ref
        if isinstance(root, ast.Name):
            by_local[root.id].append((ref, name, user))
    if by_local:
        _fix_imported(ctx, src, by_local, edits, fixed)
    if not fixed:
        return ctx.source, 0
    new = _apply(ctx.source, edits)
    if new is None:
        return ctx.source, 0
    try:
        ast.parse(new)
    except (SyntaxError, ValueError):
        return ctx.source, 0
    return new, len(fixed)


def _torch_chain(ctx: FileContext, node: ast.expr) -> bool:
    # <torch>.cuda.amp / <torch>.cpu.amp where <torch> resolves to the torch module.
    return (isinstance(node, ast.Attribute) and node.attr == "amp" and isinstance(node.value, ast.Attribute)
            and node.value.attr in _FIXABLE and ctx.qualname(node.value.value) == "torch")


def _fix_imported(ctx: FileContext, src: _Source, by_local: dict[str, list[tuple[ast.expr, str, ast.AST]]],
                  edits: list[Edit], fixed: set[int]) -> None:
    """Uses reached through ``from torch.cuda.amp import X`` or ``from torch.cuda import amp``: the
    import is rewritten together with every use of the names it binds, or nothing is."""
    loads: dict[str, int] = defaultdict(int)
    for node in ast.walk(ctx.tree):
        if isinstance(node, ast.Name) and node.id in by_local:
            loads[node.id] += 1
    imports = ctx.flow.imports
    for stmt in ctx.flow.import_nodes:
        if isinstance(stmt, ast.ImportFrom):
            if stmt.level or stmt.module not in (*_LEGACY_MODULES, "torch.cuda", "torch.cpu"):
                continue
            bound = [alias.asname or alias.name for alias in stmt.names]
        else:
            bound = [alias.asname for alias in stmt.names if alias.name in _LEGACY_MODULES and alias.asname]
        if not any(local in by_local for local in bound):
            continue
        rewrite = _import_rewrite(src, stmt)
        if rewrite is None:
            continue
        pending: list[Edit] = [rewrite]
        refs: list[int] = []
        for local in bound:
            uses = by_local.get(local, [])
            # Every load of the name must be a reported use we can rewrite (none at all is fine).
            if imports.get(local) is None or len(uses) != loads.get(local, 0):
                break
            call_edits = [_call_edits(src, name, user, ref) for ref, name, user in uses]
            if any(e is None for e in call_edits):
                break
            for e in call_edits:
                pending.extend(e or ())
            refs.extend(id(ref) for ref, _, _ in uses)
        else:
            edits.extend(pending)
            fixed.update(refs)


def _import_rewrite(src: _Source, stmt: ast.Import | ast.ImportFrom) -> Edit | None:
    """The edit turning the import's legacy module into torch.amp, when every name it imports has
    a torch.amp counterpart."""
    text = src.data[src.start(stmt):src.end(stmt)]
    if isinstance(stmt, ast.ImportFrom):
        if stmt.level:
            return None
        if stmt.module in _LEGACY_MODULES:
            device = _LEGACY_MODULES[stmt.module]
            if not all(alias.name in _FIXABLE[device] for alias in stmt.names):
                return None
            match = re.match(rb"from\s+torch\s*\.\s*(?:cuda|cpu)\s*\.\s*amp\b", text)
            return None if match is None else (src.start(stmt), src.start(stmt) + match.end(), b"from torch.amp")
        if stmt.module in ("torch.cuda", "torch.cpu") and [a.name for a in stmt.names] == ["amp"]:
            match = re.match(rb"from\s+torch\s*\.\s*(?:cuda|cpu)\b", text)
            return None if match is None else (src.start(stmt), src.start(stmt) + match.end(), b"from torch")
        return None
    aliases = [a for a in stmt.names if a.name in _LEGACY_MODULES and a.asname]
    if len(aliases) != 1:
        return None
    alias = aliases[0]
    return (src.start(alias), src.end(alias), f"torch.amp as {alias.asname}".encode())


def _call_edits(src: _Source, name: str, user: ast.AST, ref: ast.expr) -> list[Edit] | None:
    """Argument edits adding the device to one use; None when the use cannot be rewritten."""
    device, kind = DEPRECATED[name]
    if name != f"torch.{device}.amp.{kind}":
        return None  # torch.cuda.amp.autocast_mode.autocast and the like: left to the reader
    quoted = f'"{device}"'.encode()
    if not isinstance(user, ast.Call):
        if kind in ("custom_fwd", "custom_bwd"):  # bare @custom_fwd
            return [(src.end(ref), src.end(ref), f'(device_type="{device}")'.encode())]
        return None
    call = user
    open_at = src.after_open_paren(call)
    more = bool(call.args or call.keywords)
    if kind == "GradScaler":
        return [(open_at, open_at, quoted + (b", " if more else b""))]
    if kind == "autocast":
        if len(call.args) > len(_LEGACY_AUTOCAST_ARGS) or any(isinstance(a, ast.Starred) for a in call.args):
            return None
        edits = [(src.start(arg), src.start(arg), f"{keyword}=".encode())
                 for arg, keyword in zip(call.args, _LEGACY_AUTOCAST_ARGS)]
        return [(open_at, open_at, quoted + (b", " if more else b"")), *edits]
    keyword = f'device_type="{device}"'.encode()
    if call.args:
        at = src.end(call.args[-1])
        return [(at, at, b", " + keyword)]
    return [(open_at, open_at, keyword + (b", " if call.keywords else b""))]


def _apply(data: bytes, edits: list[Edit]) -> bytes | None:
    """Apply non-overlapping edits; None when two edits overlap (the fix is then abandoned).

    Insertions at the same offset keep the order in which they were produced.
    """
    unique = list(dict.fromkeys(edits))
    ordered = sorted(unique, key=lambda e: (e[0], e[1]))
    for (_, a_end, _), (b_start, _, _) in itertools.pairwise(ordered):
        if b_start < a_end:
            return None
    out = bytearray(data)
    # Right to left so earlier offsets stay valid; among edits at one offset the later-produced
    # one goes first, so the earlier-produced text ends up in front of it.
    for _, (start, end, text) in sorted(enumerate(unique), key=lambda p: (p[1][0], p[1][1], p[0]), reverse=True):
        out[start:end] = text
    return bytes(out)
