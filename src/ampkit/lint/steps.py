"""The training step along paths: which calls are scaler / optimizer / scheduler / clip events,
and which ``if`` tests are gradient-accumulation boundaries.

An accumulation boundary is recognised by its *structure*, never by a variable name:

- a counter modulo N: ``(it + 1) % accum == 0``, ``step % k``, ``not (i + 1) % n``;
- a micro-step counter compared with the last micro-step: ``micro == grad_accum - 1`` or
  ``micro + 1 == grad_accum`` where ``micro`` counts an enclosing ``for micro in range(...)`` /
  ``enumerate(...)`` loop;
- a flag derived from either: a name or ``self.`` attribute bound to such an expression
  (``step_now = (it + 1) % accum == 0``), or a call of a function of the same file that returns one
  (``def is_accum_step(i): return (i + 1) % k == 0``);
- Accelerate's ``accelerator.sync_gradients``, its public boundary flag.

A mode switch (``if accum > 1:``, ``if use_amp:``) has none of these shapes and is not a boundary.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

from ampkit.lint.astutil import const_str, expr_key, last_name
from ampkit.lint.context import FileContext, scaled_receiver
from ampkit.lint.flow import Scope, Site
from ampkit.lint.paths import CALL, Event, Path, build_paths

__all__ = ["CLIPS", "CLIP_HELPERS", "SCALER_TOKENS", "StepEvent", "clip_helpers", "is_backward_call", "is_boundary_test", "is_clip", "is_torch_clip", "scaled_backward_keys", "step_event_paths", "step_events", "step_paths"]

SCALER_TOKENS = ("GradScaler", "unscale_", ".scale(")
"""A file with none of these holds no GradScaler a rule could follow (a substring screen)."""

CLIPS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grads_with_norm_"})
CLIP_HELPERS = frozenset({
    "timm.utils.dispatch_clip_grad", "timm.utils.clip_grad.dispatch_clip_grad",
    "timm.utils.adaptive_clip_grad", "timm.utils.agc.adaptive_clip_grad",
})
"""Library functions that clip the gradients they are given with torch's clip functions (or
timm's adaptive clipping) and never unscale them."""
_METHODS = frozenset({"backward", "unscale_", "step", "update", *CLIPS})
_COUNTER_ITERS = frozenset({"range", "enumerate"})


@dataclass(frozen=True, slots=True)
class StepEvent:
    """A path event read as part of a training step.

    ``kind``: ``backward`` (of ``S.scale(loss)``; key ``S``), ``unscale_`` / ``step`` / ``update``
    (key: the receiver), ``clip`` (torch's clip functions; no key), or the event's own kind for
    the structural events (branch, loop, iter, exit, jump, end, raise)."""

    kind: str
    key: str | None
    event: Event


def is_torch_clip(ctx: FileContext, call: ast.Call) -> bool:
    """torch's own clip functions; Accelerate's / Lightning's clip methods unscale first."""
    if last_name(call.func) not in CLIPS:
        return False
    name = ctx.qualname(call.func)
    return name is not None and name.startswith("torch.nn.utils.")


def is_clip(ctx: FileContext, call: ast.Call) -> bool:
    """A call that clips gradients without unscaling them: torch's clip functions, a library
    helper known to call them (``CLIP_HELPERS``), or a function of this file that does
    (``clip_helpers``)."""
    if is_torch_clip(ctx, call):
        return True
    func = call.func
    key = expr_key(func)
    head, dot, rest = (key or "").partition(".")
    relative = ctx.flow.relative.get(head)
    if relative is not None and head not in ctx.flow.imports \
            and any(helper.endswith("." + relative + dot + rest) for helper in CLIP_HELPERS):
        # from .clip_grad import dispatch_clip_grad (timm's own modules): the package is unknown,
        # so the dotted tail must end one of the known helpers' names.
        return True
    if isinstance(func, ast.Name) and func.id not in ctx.flow.imports:
        return func.id in clip_helpers(ctx)
    return ctx.qualname(func) in CLIP_HELPERS


def clip_helpers(ctx: FileContext) -> frozenset[str]:
    """Names of the file's functions (not methods) that call torch's clip functions, directly or
    through another such function, and call no ``unscale_``: ``def dispatch_clip_grad(params,
    value, mode): ... clip_grad_norm_(params, value)``.  A name defined twice counts only when
    every definition clips.  Computed once per file."""
    memo = ctx.memo.setdefault("clip_helpers", {})
    found = memo.get(0)
    if found is not None:
        return found  # type: ignore[return-value]
    defs: dict[str, list[Scope]] = {}
    for scope in ctx.scopes:
        node = scope.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.cls is None:
            defs.setdefault(node.name, []).append(scope)
    names: set[str] = set()
    for _ in range(4):  # helpers of helpers, a few levels deep
        more = {name for name, scopes in defs.items() if name not in names and all(
            _clips_unscaled(ctx, scope, names) for scope in scopes)}
        if not more:
            break
        names |= more
    result = memo[0] = frozenset(names)
    return result


def _clips_unscaled(ctx: FileContext, scope: Scope, helpers: set[str]) -> bool:
    """``scope`` calls a clip (torch's or one of ``helpers``) and no ``unscale_``."""
    clips = False
    for site in scope.calls:
        func = site.node.func  # type: ignore[attr-defined]
        if last_name(func) == "unscale_":
            return False
        clips = clips or is_torch_clip(ctx, site.node) or (isinstance(func, ast.Name) and func.id in helpers)  # type: ignore[arg-type]
    return clips


def step_paths(ctx: FileContext, scope: Scope) -> list[Path]:
    """The paths of ``scope`` through its training calls (computed once per scope)."""
    memo = ctx.memo.setdefault("paths", {})
    found = memo.get(id(scope))
    if found is None:
        def wanted(site: Site) -> bool:
            return (last_name(site.node.func) or "") in _METHODS or is_clip(ctx, site.node)  # type: ignore[arg-type, attr-defined]
        found = memo[id(scope)] = build_paths(scope, wanted)[0]
    return found  # type: ignore[return-value]


def scaled_backward_keys(ctx: FileContext, scope: Scope) -> set[str]:
    """The scalers ``S`` of the ``S.scale(loss).backward()`` calls of ``scope`` (also through
    ``scaled = S.scale(loss); scaled.backward()``)."""
    keys: set[str] = set()
    for site in scope.calls:
        func = site.node.func  # type: ignore[attr-defined]
        if isinstance(func, ast.Attribute) and func.attr == "backward":
            receiver = func.value
            if isinstance(receiver, ast.Name):
                receiver = ctx.value_of(receiver, scope) or receiver
            key = scaled_receiver(receiver)
            if key:
                keys.add(key)
    return keys


def step_events(ctx: FileContext, scope: Scope, path: Path) -> list[StepEvent]:
    """``path`` with each call read as a training-step event (other calls dropped).

    Each event is read once per scope: the paths share their events (a prefix is one chain), so
    reading them per path would repeat the same work once per path (512 times in a big function)."""
    seen: dict[int, tuple[Event, StepEvent | None]] = ctx.memo.setdefault("step_events", {}).setdefault(
        id(scope), {})  # type: ignore[assignment]
    out: list[StepEvent] = []
    for event in path:
        known = seen.get(id(event))
        if known is None:
            known = seen[id(event)] = (event, _read(ctx, scope, event))  # the event kept: its id stays its own
        if known[1] is not None:
            out.append(known[1])
    return out


def step_event_paths(ctx: FileContext, scope: Scope) -> list[list[StepEvent]]:
    """``step_events`` of every path of ``step_paths`` (computed once per scope)."""
    memo = ctx.memo.setdefault("step_event_paths", {})
    found = memo.get(id(scope))
    if found is None:
        found = memo[id(scope)] = [step_events(ctx, scope, path) for path in step_paths(ctx, scope)]
    return found  # type: ignore[return-value]


def _read(ctx: FileContext, scope: Scope, event: Event) -> StepEvent | None:
    if event.kind != CALL:
        return StepEvent(event.kind, None, event)
    call = event.node
    assert isinstance(call, ast.Call)
    func = call.func
    if is_clip(ctx, call):
        return StepEvent("clip", None, event)
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr == "backward":
        receiver = func.value
        if isinstance(receiver, ast.Name):  # scaled = scaler.scale(loss); scaled.backward()
            receiver = ctx.value_of(receiver, scope) or receiver
        key = scaled_receiver(receiver)
        return StepEvent("backward" if key else "plain_backward", key, event)
    if func.attr in ("unscale_", "step", "update"):
        key = expr_key(func.value)
        if key:
            return StepEvent(func.attr, key, event)
    return None


def is_boundary_test(ctx: FileContext, scope: Scope, test: ast.expr, loops: Sequence[ast.AST], depth: int = 0) -> bool:
    """True when ``test`` is an accumulation boundary (see the module docstring); ``loops``: the
    loops around the ``if``, outermost first, whose counters the test may compare."""
    if depth > 3:
        return False
    counters = _counters(loops)
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and const_str(node.left) is None:
            return True
        if isinstance(node, ast.Compare) and _last_micro_step(node, counters):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "sync_gradients":
            return True
        if isinstance(node, (ast.Name, ast.Attribute)) and _derived(ctx, scope, node, loops, depth):
            return True
        if isinstance(node, ast.Call) and _returns_boundary(ctx, node, depth):
            return True
    return False


def _derived(ctx: FileContext, scope: Scope, node: ast.expr, loops: Sequence[ast.AST], depth: int) -> bool:
    key = expr_key(node)
    values = ctx.lookup(key, scope) if key else None
    return bool(values) and all(  # type: ignore[union-attr]
        v is not None and not isinstance(v, ast.Constant) and is_boundary_test(ctx, scope, v, loops, depth + 1)
        for v in values)  # type: ignore[union-attr]


def _returns_boundary(ctx: FileContext, call: ast.Call, depth: int) -> bool:
    name = last_name(call.func)
    if name is None:
        return False
    for scope in ctx.scopes:
        node = scope.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            returns = [s.node.value for s in scope.jumps if isinstance(s.node, ast.Return)]
            return bool(returns) and all(r is not None and is_boundary_test(ctx, scope, r, [], depth + 1)
                                         for r in returns)
    return False


def _counters(loops: Sequence[ast.AST]) -> set[str]:
    """Names counting the iterations of the given loops: ``for i in range(n)``, ``for i, b in enumerate(x)``."""
    names: set[str] = set()
    for loop in loops:
        if isinstance(loop, (ast.For, ast.AsyncFor)) and isinstance(loop.iter, ast.Call) \
                and last_name(loop.iter.func) in _COUNTER_ITERS:
            target = loop.target
            if isinstance(target, ast.Tuple) and target.elts:
                target = target.elts[0]
            if isinstance(target, ast.Name):
                names.add(target.id)
    return names


def _last_micro_step(node: ast.Compare, counters: set[str]) -> bool:
    """``micro == n - 1`` / ``micro + 1 == n`` for a loop counter ``micro`` and a non-constant ``n``."""
    if len(node.ops) != 1 or not isinstance(node.ops[0], ast.Eq):
        return False
    for counter, bound in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
        plus_one = isinstance(counter, ast.BinOp) and isinstance(counter.op, ast.Add) and \
            isinstance(counter.right, ast.Constant) and counter.right.value == 1
        name = counter.left if isinstance(counter, ast.BinOp) and plus_one else counter
        if not (isinstance(name, ast.Name) and name.id in counters):
            continue
        if plus_one and not isinstance(bound, ast.Constant):
            return True
        if isinstance(bound, ast.BinOp) and isinstance(bound.op, ast.Sub) and \
                isinstance(bound.right, ast.Constant) and bound.right.value == 1 and \
                not isinstance(bound.left, ast.Constant):
            return True
    return False


def is_backward_call(ctx: FileContext, call: ast.Call) -> bool:
    """``x.backward(...)`` on any receiver, or ``torch.autograd.backward(...)`` under any import name."""
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "backward") or \
        ctx.qualname(func) == "torch.autograd.backward"
