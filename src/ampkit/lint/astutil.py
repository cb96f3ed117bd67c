"""Small, allocation-light helpers over Python's ``ast`` used by every rule.

Nothing here evaluates user code: constants are folded by a tiny arithmetic interpreter that
knows literals, unary minus, ``+ - * / **`` (with bounded exponents) and a handful of named
float limits (``torch.finfo(torch.float32).min``, ``sys.float_info.max``).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass

__all__ = [
    "BF16_MAX",
    "FP16_MAX",
    "FP32_MAX",
    "Const",
    "call_arg",
    "const_bool",
    "const_str",
    "expr_key",
    "fold_constant",
    "has_star_kwargs",
    "last_name",
    "line_starts",
    "name_or_str",
    "source_lines",
    "source_pos",
]

FP16_MAX = 65504.0
BF16_MAX = 3.3895313892515355e38
FP32_MAX = 3.4028234663852886e38

# finfo-style limits by dtype spelling; float16/bfloat16 limits are in range by definition.
_FINFO_MAX = {
    "float32": FP32_MAX, "float": FP32_MAX, "single": FP32_MAX,
    "float64": 1.7976931348623157e308, "double": 1.7976931348623157e308,
    "float16": FP16_MAX, "half": FP16_MAX, "bfloat16": BF16_MAX,
}


@dataclass(frozen=True, slots=True)
class Const:
    """A folded numeric constant and whether it is a float (ints may fill integer tensors)."""

    value: float
    is_float: bool


# What ends a line for Python's tokenizer (and so for ast's line numbers): \n, \r\n or a lone \r
# (old Mac files); a form feed does not.
_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def source_lines(data: bytes) -> list[bytes]:
    """The lines of ``data`` as ast numbers them, without their line breaks (a final break leaves
    an empty last item).

    >>> source_lines(b"a\\rb\\r\\nc\\n")
    [b'a', b'b', b'c', b'']
    """
    return _LINE_BREAK.split(data)


def line_starts(data: bytes) -> list[int]:
    """The byte offset at which each line of ``data`` starts (line 1 at index 0), as ast numbers
    the lines.

    >>> line_starts(b"a\\rb\\r\\nc")
    [0, 2, 5]
    """
    return [0, *(match.end() for match in _LINE_BREAK.finditer(data))]


def last_name(node: ast.AST) -> str | None:
    """The final identifier of ``a.b.c`` or ``c``; None for anything else.

    >>> last_name(ast.parse("torch.nn.utils.clip_grad_norm_", mode="eval").body)
    'clip_grad_norm_'
    """
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def name_or_str(node: ast.AST) -> str | None:
    """The final identifier of a name or ``a.b.c`` chain, or the value of a string literal; else None.

    >>> name_or_str(ast.parse("torch.float32", mode="eval").body), name_or_str(ast.Constant("half"))
    ('float32', 'half')
    """
    return last_name(node) or const_str(node)


def source_pos(node: ast.AST) -> tuple[int, int]:
    """``(line, column offset)`` where ``node`` starts, ``(0, 0)`` for a node without a position:
    comparing two of them orders nodes in source order.

    >>> source_pos(ast.parse("x = 1").body[0].value)
    (1, 4)
    """
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def expr_key(node: ast.AST) -> str | None:
    """A textual identity for ``name`` or ``a.b.c`` chains (``self.scaler``), else None.

    Used to match a receiver across statements without resolving what it is.

    >>> expr_key(ast.parse("self.scaler", mode="eval").body)
    'self.scaler'
    >>> expr_key(ast.parse("f().scaler", mode="eval").body) is None
    True
    """
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def call_arg(call: ast.Call, index: int | None, keyword: str | None) -> ast.expr | None:
    """The argument passed positionally at ``index`` or as ``keyword=``; None when absent.

    Returns None as well when a ``*args`` before ``index`` makes the position unknowable.
    """
    if keyword is not None:
        for kw in call.keywords:
            if kw.arg == keyword:
                return kw.value
    if index is not None and index < len(call.args):
        for arg in call.args[: index + 1]:
            if isinstance(arg, ast.Starred):
                return None
        return call.args[index]
    return None


def has_star_kwargs(call: ast.Call) -> bool:
    """True when the call forwards ``**kwargs`` (any keyword may be hidden in it)."""
    return any(kw.arg is None for kw in call.keywords)


def const_bool(node: ast.AST | None) -> bool | None:
    """``True``/``False`` literals; None for anything else (including names)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return node.value
    return None


def const_str(node: ast.AST | None) -> str | None:
    """String literals; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def fold_constant(node: ast.AST, depth: int = 0) -> Const | None:
    """Fold a numeric constant expression, or return None when it is not one.

    >>> fold_constant(ast.parse("-1e9", mode="eval").body)
    Const(value=-1000000000.0, is_float=True)
    >>> fold_constant(ast.parse("float(2**30)", mode="eval").body).value
    1073741824.0
    >>> fold_constant(ast.parse("torch.finfo(torch.float32).min", mode="eval").body).value
    -3.4028234663852886e+38
    >>> fold_constant(ast.parse("torch.finfo(x.dtype).min", mode="eval").body) is None
    True
    """
    if depth > 8:
        return None
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return Const(float(value), isinstance(value, float))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = fold_constant(node.operand, depth + 1)
        if inner is None:
            return None
        return Const(-inner.value if isinstance(node.op, ast.USub) else inner.value, inner.is_float)
    if isinstance(node, ast.BinOp):
        return _fold_binop(node, depth)
    if isinstance(node, ast.Call):
        return _fold_call(node, depth)
    if isinstance(node, ast.Attribute):
        return _fold_limit(node)
    return None


def _fold_binop(node: ast.BinOp, depth: int) -> Const | None:
    left = fold_constant(node.left, depth + 1)
    right = fold_constant(node.right, depth + 1)
    if left is None or right is None:
        return None
    a, b = left.value, right.value
    is_float = left.is_float or right.is_float
    try:
        if isinstance(node.op, ast.Add):
            value = a + b
        elif isinstance(node.op, ast.Sub):
            value = a - b
        elif isinstance(node.op, ast.Mult):
            value = a * b
        elif isinstance(node.op, ast.Div):
            value, is_float = a / b, True
        elif isinstance(node.op, ast.Pow):
            if abs(b) > 4096:
                return None
            value = a**b
        else:
            return None
    except (ZeroDivisionError, OverflowError, ValueError):
        return None
    if isinstance(value, complex) or math.isnan(value):
        return None
    return Const(float(value), is_float)


def _fold_call(node: ast.Call, depth: int) -> Const | None:
    func = node.func
    if isinstance(func, ast.Name) and func.id in ("float", "int") and len(node.args) == 1 and not node.keywords:
        arg = node.args[0]
        text = const_str(arg)
        if text is not None:
            try:
                value = float(text)
            except ValueError:
                return None
            return None if math.isnan(value) else Const(value, func.id == "float")
        inner = fold_constant(arg, depth + 1)
        if inner is None:
            return None
        return Const(inner.value if func.id == "float" else float(int(inner.value)), func.id == "float")
    return None


def _fold_limit(node: ast.Attribute) -> Const | None:
    # torch.finfo(torch.float32).max / np.finfo(np.float32).min / sys.float_info.max
    if node.attr not in ("max", "min", "lowest"):
        return None
    base = node.value
    sign = -1.0 if node.attr in ("min", "lowest") else 1.0
    if isinstance(base, ast.Attribute) and base.attr == "float_info" and node.attr == "max":
        return Const(1.7976931348623157e308, True)
    if (isinstance(base, ast.Call) and last_name(base.func) == "finfo" and len(base.args) == 1
            and not base.keywords):
        dtype = name_or_str(base.args[0])  # torch.float32 / np.float32 / "float32" -> "float32"
        if dtype in _FINFO_MAX:
            return Const(sign * _FINFO_MAX[dtype], True)
    return None
