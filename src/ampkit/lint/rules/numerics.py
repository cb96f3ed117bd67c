"""Numerics rules: constants outside the float16 range, hand-written log(softmax) / log(sigmoid)
/ BCE-on-sigmoid, and running sums kept in a 16-bit float."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator

from ampkit.lint.astutil import (
    BF16_MAX,
    FP16_MAX,
    Const,
    call_arg,
    expr_key,
    fold_constant,
    last_name,
    source_pos,
)
from ampkit.lint.context import CAST_METHODS, LOW, TORCH_DTYPE_NAMES, FileContext
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope, Site
from ampkit.lint.torch_writes import WRITES

__all__ = ["RULES"]

_LIMITS = {"fp16": ("float16", FP16_MAX), "bf16": ("bfloat16", BF16_MAX)}


def _out_of_range(node: ast.expr | None, limit: float, ints: bool) -> Const | None:
    if node is None:
        return None
    const = fold_constant(node)
    if const is None or math.isinf(const.value) or abs(const.value) <= limit:
        return None
    if not const.is_float and not ints:
        return None  # a large int most often fills an integer (index) tensor
    return const


def _to_dtype(ctx: FileContext, call: ast.Call, scope: Scope) -> str | None:
    """The dtype ``x.to(...)`` converts to, from its ``dtype=`` or first positional argument."""
    return ctx.dtype_of(call_arg(call, None, "dtype") or next(iter(call.args), None), scope)


def _is_fp32(ctx: FileContext, node: ast.AST, scope: Scope, depth: int = 0) -> bool:
    """True when ``node`` is visibly a float32/float64 tensor (``x.float()``, ``.to(torch.float32)``)."""
    if depth > 3:
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("float", "double") and not node.args:
            return True
        if node.func.attr == "to":
            return _to_dtype(ctx, node, scope) in ("fp32", "fp64")
    if isinstance(node, (ast.Name, ast.Attribute)):
        # `scores = scores.float()` earlier in the scope: silent, even if the name has other bindings.
        key = expr_key(node)
        use = source_pos(node)
        for value in (ctx.lookup(key, scope) or ()) if key else ():
            if value is not None and source_pos(value) < use \
                    and _is_fp32(ctx, value, scope, depth + 1):
                return True
    return False


def _in_module_method(ctx: FileContext, scope: Scope) -> bool:
    # A method of an nn.Module subclass: its activations are float16 when the caller autocasts.
    if scope.cls is None:
        return False
    return any((last_name(base) or "").endswith("Module") for base in scope.cls.bases)


def _may_be_low(ctx: FileContext, scope: Scope, tensor: ast.AST | None) -> bool:
    if tensor is not None and _is_fp32(ctx, tensor, scope):
        return False
    return ctx.mentions_low_precision or _in_module_method(ctx, scope)


def _fills(ctx: FileContext, scope: Scope, site: Site) -> Iterator[tuple[str, ast.expr | None, ast.expr | None, str | None]]:
    """(operation, target tensor, written constant, explicit dtype) for each tensor write in a call.

    The ops and the positions of their written numbers come from torch's signatures
    (``lint.torch_writes``); ``full`` / ``new_full`` / ``full_like`` (an explicit dtype decides) and
    ``where`` (the number may be either branch) are read here.
    """
    call = site.node
    assert isinstance(call, ast.Call)
    func = call.func
    name = ctx.qualname(func)
    attr = last_name(func)
    if name is None and isinstance(func, ast.Attribute):
        receiver = func.value
        if attr == "new_full":
            dtype = ctx.dtype_of(call_arg(call, None, "dtype"), scope)
            yield attr, receiver, call_arg(call, 1, "fill_value"), dtype
        elif attr == "where":
            yield attr, receiver, call_arg(call, 1, "other"), None
        else:
            yield from _table_writes(call, attr or "", "m", receiver, shift=1)
    elif name == "torch.where" and len(call.args) == 3:
        a, b = call.args[1], call.args[2]
        if fold_constant(a) is not None and fold_constant(b) is None:
            yield "torch.where", b, a, None
        elif fold_constant(b) is not None and fold_constant(a) is None:
            yield "torch.where", a, b, None
    elif name in ("torch.full", "torch.full_like"):
        dtype_node = call_arg(call, None, "dtype")
        if name == "torch.full":
            if dtype_node is None:
                return  # torch's default float32 (or an integer dtype for an integer fill)
            yield name, None, call_arg(call, 1, "fill_value"), ctx.dtype_of(dtype_node, scope)
        else:
            dtype = None if dtype_node is None else ctx.dtype_of(dtype_node, scope)
            yield name, call_arg(call, 0, "input"), call_arg(call, 1, "fill_value"), dtype
    elif name is not None and name.startswith(("torch.nn.functional.", "torch.")):
        form = "F" if name.startswith("torch.nn.functional.") else "t"
        yield from _table_writes(call, name.rpartition(".")[2], form, call_arg(call, 0, "input"), shift=0)


def _table_writes(call: ast.Call, op: str, form: str, target: ast.expr | None,
                  shift: int) -> Iterator[tuple[str, ast.expr | None, ast.expr | None, str | None]]:
    """The written numbers of ``op`` called in ``form`` (``torch_writes``); ``shift``: 1 for a method,
    whose ``self`` is the receiver rather than the first argument."""
    forms, written = WRITES.get(op, ("", ()))
    if form in forms and op not in ("full", "full_like", "new_full", "where"):
        for position, keyword in written:
            yield op, target, call_arg(call, position - shift, keyword), None


# Screens (each a literal or a regex that starts with one, so a file is scanned at memchr speed):
# a float beyond 65504 (1e5.., 2**16.., 100000.0) or a named float limit; an integer beyond it only
# matters as an explicit fp16 fill (torch.full / new_full); `t[i] = <big>` on one line.
_BIG_EXPONENT = re.compile(rb"[0-9][eE]\+?[5-9]|[0-9][eE]\+?[0-9][0-9]")
_BIG_POWER = re.compile(rb"\*\*\s*(?:1[6-9]|[2-9]\d|\d{3})")
_BIG_INT_FILL = re.compile(rb"full\([^\n]*\b(?:6[5-9]\d{3}|[7-9]\d{4}|\d{6})")
_INDEXED_BIG = re.compile(rb"\][ \t]*=[ \t]*[^\n]*(?:\d[eE]\+?(?:[5-9]|\d\d)|finfo|float_info|\*\*|\d{5})")


@rule(code="AMP105", name="constant-outside-fp16-range",
      summary="a constant outside the fp16 range written into a tensor that may be low precision",
      needs=((_BIG_EXPONENT, _BIG_POWER, "0000.", "finfo", "float_info", _BIG_INT_FILL),
             (*sorted({op.rstrip("_") for op in WRITES}), _INDEXED_BIG)))
def amp105(ctx: FileContext) -> Iterator[Hit]:
    if not ctx.imports_torch:
        return  # numpy arrays and friends: not our concern
    for scope in ctx.scopes:
        for site in scope.calls:
            for op, tensor, value, dtype in _fills(ctx, scope, site):
                hit = _check_write(ctx, scope, op, tensor, value, dtype)
                if hit:
                    yield site.node, hit
        for site in scope.assigns:  # scores[mask] = -1e9
            stmt = site.node
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript):
                target = stmt.targets[0]
                if not _may_be_tensor(ctx, target, scope):
                    continue
                hit = _check_write(ctx, scope, "indexed assignment", target.value, stmt.value, None)
                if hit:
                    yield stmt, hit


_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.Tuple, ast.DictComp, ast.ListComp, ast.SetComp)


def _may_be_tensor(ctx: FileContext, target: ast.Subscript, scope: Scope) -> bool:
    # kwargs["max_value"] = ...: a string key indexes a mapping, never a tensor.
    if isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str):
        return False
    value = ctx.value_of(target.value, scope)
    if isinstance(value, _CONTAINERS):
        return False
    return not (isinstance(value, ast.Call) and last_name(value.func) in ("dict", "list", "defaultdict", "OrderedDict"))


def _check_write(ctx: FileContext, scope: Scope, op: str, tensor: ast.expr | None,
                 value: ast.expr | None, dtype: str | None) -> str | None:
    if dtype is not None and dtype not in LOW:
        return None
    if dtype in LOW:
        label, limit = _LIMITS[dtype]
        const = _out_of_range(value, limit, ints=True)
    else:
        if not _may_be_low(ctx, scope, tensor):
            return None
        label, limit = _LIMITS["fp16"]
        const = _out_of_range(value, limit, ints=False)
    if const is None or value is None:
        return None
    text = ctx.segment(value)
    return (f"{text} is outside the {label} range (±{limit:.6g}): {op} on a {label} tensor overflows "
            "(an error, or ±inf that turns softmax into NaN); use torch.finfo(tensor.dtype).min / .max")


_SOFTMAX = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
_SIGMOID = frozenset({"torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit"})
_MODULES = {"Sigmoid": "sigmoid", "Softmax": "softmax"}  # torch.nn modules -> the probabilities they output


def _strip_epsilon(node: ast.expr) -> ast.expr:
    # log(p + 1e-8), log(p.clamp(min=eps)), log(torch.clamp(p, min=eps)): still a hand-written log-softmax.
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        if fold_constant(node.right) is not None or isinstance(node.right, ast.Name):
            return node.left
        if fold_constant(node.left) is not None:
            return node.right
    if isinstance(node, ast.Call) and last_name(node.func) in ("clamp", "clamp_min", "clip"):
        if isinstance(node.func, ast.Attribute) and last_name(node.func.value) != "torch":
            return node.func.value
        if node.args:
            return node.args[0]
    return node


_SELECTIONS = frozenset({
    "gather", "index_select", "take_along_dim", "select", "narrow", "masked_select", "take",
    "squeeze", "unsqueeze", "view", "reshape", "flatten", "contiguous", "transpose", "permute",
})
"""Ops that pick or rearrange elements: the log of what they return is the log of the probabilities."""


def _probability_kind(ctx: FileContext, node: ast.expr, scope: Scope, depth: int = 0) -> str | None:
    """``softmax`` / ``sigmoid`` when ``node`` is such an output, or a selection of one (``p[i, y]``,
    ``p.gather(1, y)``), through a variable bound to it or a function of this file that returns it."""
    node = _strip_epsilon(node)
    if isinstance(node, ast.Subscript):  # p[torch.arange(n), y]: a selection of the probabilities
        return _probability_kind(ctx, node.value, scope, depth)
    if isinstance(node, ast.Call):
        name = ctx.qualname(node.func)
        if name in _SOFTMAX:
            return "softmax"
        if name in _SIGMOID:
            return "sigmoid"
        if name is None and isinstance(node.func, ast.Attribute):
            if node.func.attr == "softmax":
                return "softmax"
            if node.func.attr == "sigmoid" and not node.args:
                return "sigmoid"
            if node.func.attr in _SELECTIONS:
                return _probability_kind(ctx, node.func.value, scope, depth)
        if name is not None and name.startswith("torch.") and name[6:] in _SELECTIONS and node.args:
            return _probability_kind(ctx, node.args[0], scope, depth)
        if name is None and isinstance(node.func, ast.Name | ast.Attribute) and depth < 2:
            if isinstance(module := ctx.value_of(node.func, scope), ast.Call):  # self.act = nn.Sigmoid()
                return _module_kind(ctx, module, depth + 1)
            if isinstance(node.func, ast.Name):
                return _returned_kind(ctx, node.func.id, depth + 1)  # probs = my_softmax(x)
        return None
    if depth < 2 and isinstance(node, ast.Name):
        value = ctx.value_of(node, scope)
        if value is not None:
            return _probability_kind(ctx, value, scope, depth + 1)
    return None


def _module_kind(ctx: FileContext, module: ast.Call, depth: int) -> str | None:
    """What the module built by ``module`` outputs: nn.Sigmoid, nn.Softmax, a Sequential or own class ending in one."""
    name = ctx.qualname(module.func)
    if name is not None and name.startswith("torch.nn."):
        last = name.rpartition(".")[2]
        if last == "Sequential" and module.args and isinstance(module.args[-1], ast.Call) and depth < 4:
            return _module_kind(ctx, module.args[-1], depth + 1)
        return _MODULES.get(last)
    return _returned_kind(ctx, "forward", depth, module.func.id) if isinstance(module.func, ast.Name) else None


def _returned_kind(ctx: FileContext, function: str, depth: int, cls: str | None = None) -> str | None:
    """The probability kind every ``return`` of module-level ``function`` (or method of ``cls``) gives."""
    for scope in ctx.scopes:
        node = scope.node
        owner = scope.cls.name if scope.cls is not None else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function and owner == cls \
                and scope.parent is not None and (cls is not None or scope.parent.parent is None):
            kinds = {_probability_kind(ctx, r.value, scope, depth) for r in ast.walk(node)
                     if isinstance(r, ast.Return) and r.value is not None}
            return kinds.pop() if len(kinds) == 1 else None
    return None


def _log_operand(ctx: FileContext, call: ast.Call) -> ast.expr | None:
    name = ctx.qualname(call.func)
    if name == "torch.log" and len(call.args) == 1:
        return call.args[0]
    func = call.func
    if name is None and isinstance(func, ast.Attribute) and func.attr == "log" and not call.args \
            and not call.keywords:
        return func.value
    return None


def _bce_input(ctx: FileContext, call: ast.Call, scope: Scope) -> ast.expr | None:
    name = ctx.qualname(call.func)
    if name == "torch.nn.functional.binary_cross_entropy":
        return call_arg(call, 0, "input")
    if isinstance(call.func, ast.Name | ast.Attribute) and name is None:
        loss = ctx.value_of(call.func, scope)  # criterion = nn.BCELoss(); criterion(p, y)
        if isinstance(loss, ast.Call) and last_name(loss.func) == "BCELoss":
            return call_arg(call, 0, "input")
    if isinstance(call.func, ast.Call) and last_name(call.func.func) == "BCELoss":  # nn.BCELoss()(p, y)
        return call_arg(call, 0, "input")
    return None


@rule(code="AMP106", name="hand-written-log-softmax",
      summary="log(softmax(x)) / log(sigmoid(x)) by hand, or binary_cross_entropy on a sigmoid output",
      needs=(("softmax", "sigmoid", "expit", "Softmax", "Sigmoid"), ("log(", "binary_cross_entropy", "BCELoss")))
def amp106(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        for site in scope.calls:
            call = site.node
            assert isinstance(call, ast.Call)
            operand = _log_operand(ctx, call)
            if operand is not None:
                kind = _probability_kind(ctx, operand, scope)
                if kind == "softmax":
                    yield call, ("log of a softmax underflows to -inf in low precision and is computed twice; "
                                 "use torch.log_softmax(x, dim) / F.log_softmax")
                elif kind == "sigmoid":
                    yield call, ("log of a sigmoid underflows to -inf for large negative inputs; "
                                 "use F.logsigmoid(x)")
                continue
            probs = _bce_input(ctx, call, scope)
            if probs is not None and _probability_kind(ctx, probs, scope) == "sigmoid":
                yield call, ("binary_cross_entropy on a sigmoid output saturates in low precision and is "
                             "refused under autocast; pass the logits to "
                             "F.binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss")


_FACTORIES = frozenset({
    "torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.tensor", "torch.as_tensor",
    "torch.zeros_like", "torch.ones_like", "torch.empty_like", "torch.full_like",
})
_NEW_FACTORIES = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})


def _low_creation(ctx: FileContext, node: ast.expr | None, scope: Scope) -> str | None:
    """``fp16`` / ``bf16`` when ``node`` creates a new tensor of that dtype, else None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    name = ctx.qualname(func)
    if name in _FACTORIES or (name is None and last_name(func) in _NEW_FACTORIES):
        dtype = ctx.dtype_of(call_arg(node, None, "dtype"), scope)
        return dtype if dtype in LOW else None
    if isinstance(func, ast.Attribute) and _is_factory(ctx, func.value):
        if func.attr in CAST_METHODS and not node.args:
            return CAST_METHODS[func.attr]
        if func.attr == "to":
            dtype = _to_dtype(ctx, node, scope)
            return dtype if dtype in LOW else None
    return None


def _is_factory(ctx: FileContext, node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and (ctx.qualname(node.func) in _FACTORIES
                                           or last_name(node.func) in _NEW_FACTORIES)


_BLENDS = frozenset({"add_", "sub_", "lerp_", "addcmul_", "addcdiv_"})
"""In-place methods that blend new values into the tensor they are called on (``mul_`` / ``div_``
alone only rescale it; chained into one of these, ``ema.mul_(d).add_(x, alpha=1 - d)``, they blend)."""


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _receiver_root(node: ast.expr) -> ast.expr:
    """``ema`` of ``ema.mul_(d).add_(x)``: the object a chain of method calls starts from."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return node


def _is_blend(value: ast.expr, name: str) -> bool:
    """A new value of ``name`` computed from ``name`` and something else: ``name + x``,
    ``0.99 * name + 0.01 * x``, ``torch.lerp(name, x, w)`` (not a cast ``name.float()``)."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub)) and any(
            isinstance(side, ast.Name) and side.id == name for side in (value.left, value.right)):
        return True  # name + x, name + 1
    # Anything else must mix in another value (a cast, name.float(), or a rescale, name * 0.5, does not).
    others = [n for n in ast.walk(value) if isinstance(n, ast.Name) and n.id not in (name, "torch")]
    return isinstance(value, (ast.BinOp, ast.Call)) and _mentions(value, name) and bool(others)


def _is_accumulation(stmt: ast.AST, name: str) -> bool:
    """A running sum or average of ``name``, however it is assigned: ``name += x`` / ``-=``, or a
    rebinding to a blend of ``name`` and new values (``name = name + x``, ``name = d * name + (1 - d) * x``,
    ``name = torch.lerp(name, x, w)``)."""
    if isinstance(stmt, ast.AugAssign):
        return isinstance(stmt.op, (ast.Add, ast.Sub)) and isinstance(stmt.target, ast.Name) \
            and stmt.target.id == name
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        return isinstance(target, ast.Name) and target.id == name and _is_blend(stmt.value, name)
    return False


def _accumulations(scope: Scope, name: str) -> Iterator[tuple[ast.AST, Site]]:
    for site in scope.assigns:
        if _is_accumulation(site.node, name):
            yield site.node, site
    for site in scope.calls:
        func = site.node.func  # type: ignore[attr-defined]
        if not isinstance(func, ast.Attribute):
            continue
        root = _receiver_root(func.value)
        if not (isinstance(root, ast.Name) and root.id == name):
            continue
        if func.attr in _BLENDS:  # name.add_(x), name.lerp_(x, w), name.mul_(d).add_(x, alpha=...)
            yield site.node, site
        elif func.attr == "copy_" and site.node.args and _is_blend(site.node.args[0], name):  # type: ignore[attr-defined]
            yield site.node, site  # name.copy_(d * name + (1 - d) * x)


# Screen: a factory with a 16-bit dtype on one line, or a name bound to a 16-bit dtype.
_LOW_FACTORY = re.compile(rb"(?:zeros|ones|empty|full|tensor)(?:_like)?\([^\n]*(?:float16|bfloat16|half)")
_LOW_DTYPE_BINDING = re.compile(rb"=[ \t]*torch\.(?:float16|half|bfloat16)\b")


@rule(code="AMP114", name="low-precision-accumulator",
      summary="a running sum or average kept in fp16/bf16 and updated in a loop",
      needs=(("float16", "bfloat16", "half"), (_LOW_FACTORY, _LOW_DTYPE_BINDING)))
def amp114(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        for name, values in scope.bindings.items():
            if "." in name or not any(_low_creation(ctx, v, scope) for v in values):
                continue  # cheap filter first: the scans below are per candidate name
            creations = [site for site in scope.assigns if isinstance(site.node, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == name for t in site.node.targets)]
            updates = list(_accumulations(scope, name))
            update_nodes = {id(node) for node, _ in updates}
            # Every binding must be a low-precision creation or an accumulation; anything else
            # (x = x.float(), a parameter, a loop variable) makes the dtype unknown.
            creations = [s for s in creations if id(s.node) not in update_nodes]
            if len(values) != len(creations) + sum(1 for n, _ in updates if isinstance(n, ast.Assign)):
                continue
            dtypes = {_low_creation(ctx, s.node.value, scope) for s in creations}  # type: ignore[attr-defined]
            if len(dtypes) != 1 or None in dtypes:
                continue
            dtype = TORCH_DTYPE_NAMES[dtypes.pop()]  # type: ignore[index]
            for node, site in updates:
                if any(all(not c.inside(loop) for c in creations) for loop in site.loops()):
                    yield node, (f"`{name}` is a {dtype} running sum or average updated in a loop: once it is "
                                 f"~{2 ** 11 if dtype == 'float16' else 2 ** 8}x an update, updates round "
                                 "away; accumulate in torch.float32 and cast once at the end")


RULES = (amp105, amp106, amp114)
