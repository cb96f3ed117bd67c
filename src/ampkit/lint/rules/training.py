"""Training-loop rules: a whole model trained in a 16-bit float, and backward / optimizer steps
inside an autocast region."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampkit.lint.astutil import call_arg, expr_key
from ampkit.lint.context import CAST_METHODS, LOW, TORCH_DTYPE_NAMES, FileContext
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope, Site
from ampkit.lint.steps import is_backward_call

__all__ = ["RULES"]


def _conversion(ctx: FileContext, site: Site, scope: Scope) -> tuple[str, str] | None:
    """(model key, dtype name) when the call converts a whole object to fp16/bf16."""
    call = site.node
    assert isinstance(call, ast.Call)
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in CAST_METHODS and not call.args and not call.keywords:
        dtype = TORCH_DTYPE_NAMES[CAST_METHODS[func.attr]]
    elif func.attr == "to":
        candidates = [call_arg(call, None, "dtype"), *call.args]
        found = [ctx.dtype_of(c, scope) for c in candidates if c is not None]
        low = [d for d in found if d in LOW]
        if not low:
            return None
        dtype = TORCH_DTYPE_NAMES[low[0]]
    else:
        return None
    stmt = site.stmt
    if isinstance(stmt, ast.Assign) and stmt.value is call and len(stmt.targets) == 1:
        key = expr_key(stmt.targets[0])  # model = Net().to(device).half()
    else:
        key = expr_key(func.value)  # model.half()
    return (key, dtype) if key else None


def _optimized_model(ctx: FileContext, call: ast.Call, scope: Scope) -> str | None:
    """The key ``m`` of ``torch.optim.X(m.parameters(), ...)``, else None."""
    if not ctx.is_optimizer_call(call):
        return None
    params = call_arg(call, 0, "params")
    for _ in range(2):
        if isinstance(params, ast.Call) and isinstance(params.func, ast.Name) and params.func.id == "list" \
                and params.args:
            params = params.args[0]
        if isinstance(params, ast.Call) and isinstance(params.func, ast.Attribute) \
                and params.func.attr in ("parameters", "named_parameters"):
            return expr_key(params.func.value)
        if isinstance(params, ast.Name):
            params = ctx.value_of(params, scope)
    return None


@rule(code="AMP107", name="model-trained-in-half",
      summary="a whole model converted to fp16/bf16 (.half(), .to(torch.float16), .bfloat16()) and trained",
      needs=((".half(", "bfloat16", "float16", "torch.half"), ("parameters(",)))
def amp107(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        conversions = []
        optimized: set[str] = set()
        for site in scope.calls:
            conversion = _conversion(ctx, site, scope)
            if conversion is not None:
                conversions.append((site, conversion))
            model = _optimized_model(ctx, site.node, scope)  # type: ignore[arg-type]
            if model is not None:
                optimized.add(model)
        for site, (key, dtype) in conversions:
            if key in optimized:
                yield site.node, (f"{key} is converted to {dtype} and its parameters are trained: updates "
                                  f"smaller than the {dtype} resolution are lost; keep float32 weights and "
                                  "use torch.autocast (with a GradScaler for float16)")


def _is_step_or_backward(ctx: FileContext, call: ast.Call, scope: Scope) -> str | None:
    if is_backward_call(ctx, call):
        return "backward()" if isinstance(call.func, ast.Attribute) else "torch.autograd.backward()"
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "step":
        key = expr_key(func.value)
        if ctx.is_optimizer(key, scope) or ctx.is_scaler(key, scope):
            return f"{key}.step()"
    return None


@rule(code="AMP108", name="step-inside-autocast",
      summary="optimizer.step() or .backward() inside an autocast block",
      needs=(("autocast",), ("backward", "step(")))
def amp108(ctx: FileContext) -> Iterator[Hit]:
    if ctx.is_test_file:
        return  # a test of autocast runs backward inside the region on purpose
    for scope in ctx.scopes:
        if not scope.withs:
            continue
        regions = {id(site.node) for site, _ in ctx.autocast_withs(scope)}
        if not regions:
            continue
        disabled = {id(site.node) for site, info in ctx.autocast_items(scope) if info.enabled is False}
        for site in scope.calls:
            what = None
            for stmt, _ in reversed(site.frames):
                if id(stmt) in disabled:
                    break
                if id(stmt) in regions:
                    what = _is_step_or_backward(ctx, site.node, scope)  # type: ignore[arg-type]
                    break
            if what:
                yield site.node, (f"{what} inside an autocast region: backward and the optimizer update "
                                  "should run outside it; end the `with autocast` block after the loss")


RULES = (amp107, amp108)
