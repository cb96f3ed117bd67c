"""API-usage rules: deprecated AMP entry points, device-less queries, custom autograd Functions
under autocast, and unsafe ``torch.load``."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ampkit.lint.astutil import (
    call_arg,
    const_bool,
    const_str,
    expr_key,
    has_star_kwargs,
    last_name,
    name_or_str,
)
from ampkit.lint.context import FileContext
from ampkit.lint.core import Hit, rule
from ampkit.lint.rules.releases import before_release, project_torch_floor

__all__ = ["DEPRECATED", "RULES", "deprecated_message", "deprecated_references"]

# qualified name -> (device, name in torch.amp)
DEPRECATED: dict[str, tuple[str, str]] = {}
for _device, _names in (("cuda", ("autocast", "GradScaler", "custom_fwd", "custom_bwd")),
                        ("cpu", ("autocast", "GradScaler"))):
    for _name in _names:
        DEPRECATED[f"torch.{_device}.amp.{_name}"] = (_device, _name)
        _module = "grad_scaler" if _name == "GradScaler" else "autocast_mode"
        DEPRECATED[f"torch.{_device}.amp.{_module}.{_name}"] = (_device, _name)
_DEPRECATED_NAMES = frozenset(name for _, name in DEPRECATED.values())


def deprecated_message(qualified: str) -> str:
    device, name = DEPRECATED[qualified]
    if name in ("autocast", "GradScaler"):
        replacement = f'torch.amp.{name}("{device}", ...)'
    else:
        replacement = f'torch.amp.{name}(device_type="{device}")'
    return f"torch.{device}.amp.{name} is deprecated; use {replacement}"


def deprecated_references(ctx: FileContext) -> Iterator[tuple[ast.expr, str, ast.AST]]:
    """Every *use* of a deprecated AMP object: (reference, qualified name, the call or decorated
    definition using it).  Calls and decorators are what the deprecation is about; a bare reference
    (``func in (torch.cuda.amp.autocast, ...)``, ``isinstance(s, torch.cuda.amp.GradScaler)``)
    constructs nothing and is not reported."""
    imports = ctx.flow.imports
    local_names = {local for local, target in imports.items() if target in DEPRECATED}
    if not local_names and not any(name in ctx.source for name in (b"cuda.amp", b"cpu.amp", b"import amp")):
        return
    for node in ast.walk(ctx.tree):
        if isinstance(node, ast.Call):
            candidates: list[tuple[ast.expr, ast.AST]] = [(node.func, node)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            candidates = [(d, node) for d in node.decorator_list if not isinstance(d, ast.Call)]
        else:
            continue
        for ref, user in candidates:
            name = None
            if isinstance(ref, ast.Attribute) and ref.attr in _DEPRECATED_NAMES:
                name = ctx.qualname(ref)
            elif isinstance(ref, ast.Name) and ref.id in local_names:
                name = imports[ref.id]
            if name in DEPRECATED and not _compat_branch(ctx, user):
                yield ref, name, user  # type: ignore[misc]


_VERSION_WORDS = re.compile(r"version|torch_(?:greater|less|ge|gt|le|lt)|torch_\d", re.IGNORECASE)


def _compat_branch(ctx: FileContext, node: ast.AST) -> bool:
    """True inside a torch-version / feature check or an ``except`` fallback: the old API is then
    the deliberate choice for old releases (``GradScaler("cuda") if TORCH_2_4 else torch.cuda.amp...``)."""
    parents = ctx.parents
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.ExceptHandler):
            return True
        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test and _is_version_test(parent.test):
            return True
        if isinstance(child, ast.stmt) and _after_version_return(parent, child):
            return True
        child, parent = parent, parents.get(id(parent))
    return False


def _after_version_return(parent: ast.AST, stmt: ast.stmt) -> bool:
    # if torch_version >= (2, 4): return torch.amp.GradScaler("cuda")
    # return torch.cuda.amp.GradScaler()          <- the implicit else branch
    for fld in ("body", "orelse", "finalbody"):
        block = getattr(parent, fld, None)
        if isinstance(block, list) and any(s is stmt for s in block):
            for before in block[: next(i for i, s in enumerate(block) if s is stmt)]:
                if (isinstance(before, ast.If) and before.body and isinstance(before.body[-1], (ast.Return, ast.Raise))
                        and _is_version_test(before.test)):
                    return True
    return False


def _is_version_test(test: ast.expr) -> bool:
    for node in ast.walk(test):
        text = name_or_str(node)
        if text is None:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            # Feature detection on torch counts too (hasattr(torch.amp, "GradScaler")); hasattr on
            # anything else (hasattr(self, "x")) says nothing about the installed release.
            target = expr_key(node.args[0]) if node.func.id == "hasattr" and node.args else None
            text = "version" if target is not None and target.partition(".")[0] == "torch" else ""
        if _VERSION_WORDS.search(text):
            return True
    return False


@rule(code="AMP101", name="deprecated-amp-api",
      summary="deprecated torch.cuda.amp / torch.cpu.amp API (autocast, GradScaler, custom_fwd, custom_bwd)",
      needs=(("cuda.amp", "cpu.amp", "cuda import amp", "cpu import amp"),))
def amp101(ctx: FileContext) -> Iterator[Hit]:
    for node, name, _ in deprecated_references(ctx):
        yield node, deprecated_message(name)


_FUNCTION_BASES = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})


def _is_autograd_function(ctx: FileContext, cls: ast.ClassDef) -> bool:
    for base in cls.bases:
        name = ctx.qualname(base)
        if name in _FUNCTION_BASES:
            return True
        key = expr_key(base)
        if name is None and key is not None and key.endswith("autograd.Function"):
            return True
    return False


def _manages_autocast(cls: ast.ClassDef) -> bool:
    # A Function that reads or re-enters the autocast state itself (torch.utils.checkpoint's
    # CheckpointFunction) has made its own choice; the rule cannot judge it.
    return any("autocast" in (last_name(node) or "") for node in ast.walk(cls))


def _is_passthrough(cls: ast.ClassDef) -> bool:
    # forward computes nothing (returns its input, raises): there is no dtype behaviour to fix.
    for method in cls.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.name == "forward":
            return not any(isinstance(node, (ast.Call, ast.BinOp)) for stmt in method.body
                           for node in ast.walk(stmt))
    return False


def _has_decorator(method: ast.FunctionDef | ast.AsyncFunctionDef, wanted: str) -> bool:
    for decorator in method.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if last_name(target) == wanted:
            return True
    return False


@rule(code="AMP109", name="autograd-function-without-custom-fwd",
      summary="custom torch.autograd.Function without torch.amp.custom_fwd/custom_bwd in a file that uses autocast",
      needs=(("Function",), ("autocast",)))
def amp109(ctx: FileContext) -> Iterator[Hit]:
    if not ctx.uses_autocast:
        return
    for scope in ctx.scopes:
        cls = scope.node
        if not isinstance(cls, ast.ClassDef) or not _is_autograd_function(ctx, cls):
            continue
        if _manages_autocast(cls) or _is_passthrough(cls):
            continue
        for method in cls.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if method.name == "forward" and not _has_decorator(method, "custom_fwd"):
                yield method, (f"{cls.name}.forward runs under the caller's autocast with mixed input "
                               "dtypes; decorate it with @torch.amp.custom_fwd(device_type=...) "
                               "(cast_inputs=torch.float32 to run it in fp32)")
            elif method.name == "backward" and not _has_decorator(method, "custom_bwd"):
                yield method, (f"{cls.name}.backward does not run with the autocast state of its "
                               "forward; decorate it with @torch.amp.custom_bwd(device_type=...)")


@rule(code="AMP110", name="autocast-query-without-device",
      summary="torch.is_autocast_enabled() without a device argument",
      needs=(("is_autocast_enabled",),))
def amp110(ctx: FileContext) -> Iterator[Hit]:
    for _, site in ctx.calls():
        call = site.node
        assert isinstance(call, ast.Call)
        if (not call.args and not call.keywords and ctx.qualname(call.func) == "torch.is_autocast_enabled"
                and not before_release(ctx, call, (2, 4), lambda c: bool(c.args or c.keywords)
                                       and ctx.qualname(c.func) == "torch.is_autocast_enabled")
                and not _cuda_known(ctx, call) and not (ctx.is_test_file and _in_assert(ctx, call))):
            yield call, ("torch.is_autocast_enabled() without a device answers for CUDA only (False "
                         "under CPU/XPU/MPS autocast); pass the device: torch.is_autocast_enabled(x.device.type)")


def _cuda_known(ctx: FileContext, node: ast.AST) -> bool:
    """True in the branch of a device test that leaves CUDA: the body of ``if x.device.type ==
    "cuda"`` (or ``!= "cpu"``), the ``else`` of ``if x.device.type == "cpu"`` (whose body asks
    ``is_autocast_cpu_enabled()``).  The device-less query answers for CUDA, which is right there."""
    parents = ctx.parents
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
            in_body = child is parent.body or (isinstance(parent.body, list) and any(s is child for s in parent.body))
            device = _tested_device(parent.test)
            if device is not None and (device == ("cuda", in_body) or device == ("cpu", not in_body)):
                return True
        child, parent = parent, parents.get(id(parent))
    return False


def _tested_device(test: ast.expr) -> tuple[str, bool] | None:
    """``(device, equal)`` for ``<device expression> == / != "<device>"``: ``x.device.type == "cpu"``
    is ``("cpu", True)``; None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))):
        return None
    left, right = test.left, test.comparators[0]
    literal = const_str(right) if const_str(right) is not None else const_str(left)
    other = left if const_str(right) is not None else right
    if literal is None or "device" not in (expr_key(other) or ast.unparse(other)):
        return None
    return literal.partition(":")[0], isinstance(test.ops[0], ast.Eq)


def _in_assert(ctx: FileContext, node: ast.AST) -> bool:
    # A test pins its device through its parameters (RunIf(min_cuda_gpus=1)); a query asserted
    # there fails the test when it answers for the wrong device, it never changes what runs.
    parent = ctx.parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.stmt):
        parent = ctx.parents.get(id(parent))
    return isinstance(parent, ast.Assert)


_LOADERS = frozenset({"torch.load", "torch.serialization.load"})


@rule(code="AMP113", name="unsafe-torch-load",
      summary="torch.load without weights_only=True",
      needs=(("torch.load(", "serialization.load(", "import torch as", "import load"),))
def amp113(ctx: FileContext) -> Iterator[Hit]:
    for _, site in ctx.calls():
        call = site.node
        assert isinstance(call, ast.Call)
        if ctx.qualname(call.func) not in _LOADERS:
            continue
        flag = call_arg(call, None, "weights_only")
        if flag is None and before_release(ctx, call, (1, 13), lambda c: ctx.qualname(c.func) in _LOADERS
                                           and call_arg(c, None, "weights_only") is not None):
            continue  # torch before 1.13 has no weights_only: the bare call is the only one there is
        if flag is None:
            if has_star_kwargs(call):
                continue  # may be passed through **kwargs: cannot decide
            if _requires_safe_default(ctx):
                continue  # the project needs torch >= 2.6, whose default is weights_only=True
            yield call, ("torch.load without weights_only=True unpickles arbitrary code from the file "
                         "(the default before torch 2.6); pass weights_only=True")
        # An explicit weights_only=False is a choice written where a reviewer sees it: a full
        # checkpoint (config, trainer, RNG state) needs it.  It is reported only where it is needless
        # or undoes a safe load: the result goes straight into load_state_dict (tensors, which
        # weights_only=True loads), or it retries a weights_only=True load that raised.
        elif const_bool(flag) is False and _feeds_load_state_dict(ctx, call):
            yield call, ("torch.load(weights_only=False) of a state dict unpickles arbitrary code for nothing: "
                         "load_state_dict takes tensors, which weights_only=True loads; pass weights_only=True")
        elif const_bool(flag) is False and _retries_safe_load(ctx, call):
            yield call, ("torch.load(weights_only=False) unpickles arbitrary code from the file; "
                         "load tensors and state dicts with weights_only=True")


def _requires_safe_default(ctx: FileContext) -> bool:
    floor = project_torch_floor(ctx.path)
    return floor is not None and floor >= (2, 6)


def _feeds_load_state_dict(ctx: FileContext, call: ast.Call) -> bool:
    parent = ctx.parents.get(id(call))
    return (isinstance(parent, ast.Call) and call in parent.args and isinstance(parent.func, ast.Attribute)
            and parent.func.attr == "load_state_dict")


def _retries_safe_load(ctx: FileContext, call: ast.Call) -> bool:
    """``call`` is in an ``except`` of a ``try`` that loads with ``weights_only=True``: it unpickles
    exactly the files the safe load refused."""
    parents = ctx.parents
    parent = parents.get(id(call))
    while parent is not None:
        if isinstance(parent, ast.ExceptHandler):
            body = getattr(parents.get(id(parent)), "body", [])
            if any(isinstance(n, ast.Call) and ctx.qualname(n.func) in _LOADERS
                   and const_bool(call_arg(n, None, "weights_only")) is True
                   for stmt in body for n in ast.walk(stmt)):
                return True
        parent = parents.get(id(parent))
    return False


RULES = (amp101, amp109, amp110, amp113)
