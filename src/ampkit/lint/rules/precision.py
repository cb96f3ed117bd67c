"""The scaler against the autocast dtype: a GradScaler where none is needed (bf16, AMP111) and
none where one is (fp16, AMP112)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampkit.lint.astutil import call_arg, const_str, expr_key
from ampkit.lint.context import FileContext, scaled_receiver
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope
from ampkit.lint.paths import test_key
from ampkit.lint.steps import scaled_backward_keys

__all__ = ["RULES"]


@rule(code="AMP111", name="scaler-with-bf16",
      summary="GradScaler used together with bf16 autocast",
      needs=(("GradScaler",), ("autocast",)))
def amp111(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in ctx.scopes:
        regions = ctx.autocast_withs(scope)
        if not regions:
            continue
        keys = scaled_backward_keys(ctx, scope)
        keys.update(key for site in scope.calls if (key := scaled_receiver(site.node)))
        for key in sorted(keys):
            construction = ctx.scaler_construction(key, scope)
            if construction is None or id(construction) in reported:
                continue
            enabled = ctx.scaler_enabled(construction)
            flag = None if enabled is True else call_arg(construction, None, "enabled")
            if enabled is False or any(_dtype_when(ctx, scope, info.call, flag) != "bf16" for _, info in regions):
                continue  # an fp16 / undecidable region does need the scaler
            reported.add(id(construction))
            if flag is None:
                yield construction, ("GradScaler with bfloat16 autocast: bf16 has float32's exponent range and "
                                     "needs no loss scaling; the scaler only adds skipped steps and host syncs; "
                                     "drop it (or enable it only for float16)")
            else:
                yield construction, ("GradScaler enabled by the same condition that selects bfloat16 autocast: it "
                                     "scales exactly when no scaling is needed (bf16 has float32's exponent range) "
                                     "and never for float16; enable it for float16 instead "
                                     "(enabled=dtype == torch.float16)")


_BF16_WORDS = frozenset({"bfloat16", "bf16"})


def _dtype_when(ctx: FileContext, scope: Scope, call: ast.Call, flag: ast.expr | None, depth: int = 0) -> str | None:
    """The dtype of the autocast ``call`` on the paths where ``flag`` (a scaler's ``enabled=``) is
    true: ``torch.bfloat16 if flag else ...``, or ``flag`` being ``dtype == torch.bfloat16`` for the
    region's own dtype.  Without a flag, the region's dtype."""
    info = ctx.autocast_info(call, scope)
    if info is None or flag is None:
        return info.dtype if info else None
    node = call_arg(call, 1, "dtype")
    if isinstance(flag, ast.Name) and depth < 2:
        bound = ctx.value_of(flag, scope)
        if bound is not None and not isinstance(bound, ast.Constant):
            return _dtype_when(ctx, scope, call, bound, depth + 1)
    chosen = ctx.value_of(node, scope) if isinstance(node, (ast.Name, ast.Attribute)) else node
    if isinstance(chosen, ast.IfExp):
        key, polarity = test_key(chosen.test)
        flag_key, flag_polarity = test_key(flag)
        if key == flag_key:
            return ctx.dtype_of(chosen.body if polarity == flag_polarity else chosen.orelse, scope)
    if isinstance(flag, ast.Compare) and len(flag.ops) == 1 and isinstance(flag.ops[0], ast.Eq):
        sides = (flag.left, flag.comparators[0])
        read = {expr_key(node) if node is not None else None, _lookup_key(chosen)} - {None}
        for this, other in (sides, sides[::-1]):
            bf16 = ctx.dtype_of(other, scope) == "bf16" or const_str(other) in _BF16_WORDS
            if bf16 and expr_key(this) in read:
                return "bf16"
    return None


def _lookup_key(node: ast.AST | None) -> str | None:
    """``k`` for a table lookup ``{...}[k]`` (a dtype chosen by name)."""
    if isinstance(node, ast.Subscript):
        return expr_key(node.slice)
    return None


_SCALING_TOKENS = (b"Scaler", b"scaler", b". scale (", b"loss_scale", b"MixedPrecision")
"""Words of loss scaling in the code (tokens joined by spaces: ``. scale (`` is a ``.scale(`` call)."""


@rule(code="AMP112", name="fp16-without-loss-scaling",
      summary="float16 autocast in a training loop (backward present) with no loss scaling",
      needs=(("autocast",), ("backward",)))
def amp112(ctx: FileContext) -> Iterator[Hit]:
    if ctx.is_test_file:
        return  # a test's backward checks that gradients flow; no training run depends on it
    if any(token in ctx.code_source for token in _SCALING_TOKENS):
        return  # some loss scaling exists somewhere: cannot tell which path uses it
    for scope in ctx.scopes:
        regions = [(site, info) for site, info in ctx.autocast_withs(scope) if info.may_be_fp16]
        if not regions:
            continue
        backwards = [site for site in scope.calls if _plain_backward(ctx, site.node)]  # type: ignore[arg-type]
        for region, info in regions:
            loop = region.innermost_loop()
            if any(b.pos > region.pos and (loop is None or b.inside(loop)) for b in backwards):
                yield info.call, ("float16 autocast with a plain .backward() and no loss scaling: small "
                                  "gradients underflow to zero in float16; scale the loss with "
                                  "torch.amp.GradScaler (or train in bfloat16)")


def _plain_backward(ctx: FileContext, call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "backward":
        # x.backward(loss) is a framework's scaled backward (accelerate, deepspeed); (loss * s).backward()
        # is manual scaling.
        return not call.args and not isinstance(func.value, ast.BinOp) and scaled_receiver(func.value) is None
    return ctx.qualname(func) == "torch.autograd.backward"


RULES = (amp111, amp112)
