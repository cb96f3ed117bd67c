"""Loss-scaler rules: the order and alignment of scale → backward → unscale_ → clip → step →
update, the scaler in checkpoints, and a scaler where none is needed (bf16) or none where one is
(fp16)."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator

from ampkit.lint.astutil import call_arg, const_str, expr_key, last_name, source_pos
from ampkit.lint.context import FileContext, scaled_receiver
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope, Site

__all__ = ["RULES"]

_SCALER_METHODS = frozenset({"unscale_", "step", "update"})
# A file with none of these holds no GradScaler a rule could follow.
_SCALER_TOKENS = ("GradScaler", "unscale_", ".scale(")


def _events(ctx: FileContext, scope: Scope) -> dict[tuple[str, str], list[Site]]:
    """(kind, scaler key) -> sites, kind in backward (scaled) / unscale_ / step / update."""
    events: dict[tuple[str, str], list[Site]] = defaultdict(list)
    for site in scope.calls:
        func = site.node.func  # type: ignore[attr-defined]
        if not isinstance(func, ast.Attribute):
            continue
        if func.attr == "backward":
            receiver = func.value
            if isinstance(receiver, ast.Name):  # scaled = scaler.scale(loss); scaled.backward()
                receiver = ctx.value_of(receiver, scope) or receiver
            key = scaled_receiver(receiver)
            if key:
                events["backward", key].append(site)
        elif func.attr in _SCALER_METHODS:
            key = expr_key(func.value)
            if key:
                events[func.attr, key].append(site)
    return events


_CLIPS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grads_with_norm_"})


def _is_clip(ctx: FileContext, call: ast.Call) -> bool:
    if last_name(call.func) not in _CLIPS:
        return False
    # Accelerate's / Lightning's own clip methods unscale first; only torch's functions are judged.
    name = ctx.qualname(call.func)
    return name is not None and name.startswith("torch.nn.utils.")


@rule(code="AMP102", name="clip-before-unscale",
      summary="gradient clipping after scaler.scale(loss).backward() with no scaler.unscale_ before it",
      needs=(("clip_grad",), ("scale(",)))
def amp102(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        events = _events(ctx, scope)
        backwards = [(site, key) for (kind, key), sites in events.items() if kind == "backward"
                     for site in sites]
        if not backwards:
            continue
        for site in scope.calls:
            if not _is_clip(ctx, site.node):  # type: ignore[arg-type]
                continue
            before = [(b, key) for b, key in backwards if b.pos < site.pos]
            if not before:
                continue
            last, key = max(before, key=lambda pair: pair[0].pos)
            if any(last.pos < u.pos < site.pos for u in events.get(("unscale_", key), ())):
                continue
            yield site.node, (f"gradients are clipped while still multiplied by the loss scale (after "
                              f"{key}.scale(...).backward()); call {key}.unscale_(optimizer) before clipping")


_BOUNDARY_WORDS = ("accum", "boundary", "sync_grad", "micro", "grad_acc")


def _is_boundary_test(test: ast.expr) -> bool:
    """An ``if`` test that reads like an accumulation boundary: ``(i + 1) % k == 0``, ``sync_gradients``."""
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
        name = last_name(node)
        if name and any(word in name.lower() for word in _BOUNDARY_WORDS):
            return True
    return False


def _boundary_ifs(site: Site, loop: ast.AST) -> list[ast.If]:
    return [stmt for stmt, _ in site.frames_below(loop)
            if isinstance(stmt, ast.If) and _is_boundary_test(stmt.test)]


@rule(code="AMP103", name="scaler-off-accumulation-boundary",
      summary="scaler.update() / unscale_() / step() not aligned with the gradient-accumulation boundary",
      needs=(("scale(",), ("backward",), ("update(", "unscale_(")))
def amp103(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        events = _events(ctx, scope)
        reported: set[int] = set()
        for (kind, key), backwards in events.items():
            if kind != "backward":
                continue
            steps = events.get(("step", key), [])
            others = [*events.get(("update", key), ()), *events.get(("unscale_", key), ())]
            for backward in backwards:
                loop = backward.innermost_loop()
                if loop is None:
                    continue
                yield from _micro_loop(key, loop, steps, others, reported)
                yield from _boundary_if(key, backward, loop, steps, others, reported)


def _micro_loop(key: str, loop: ast.AST, steps: list[Site], others: list[Site],
                reported: set[int]) -> Iterator[Hit]:
    # The optimizer steps after the micro-batch loop, yet update/unscale_ run inside it.
    if any(s.inside(loop) for s in steps):
        return
    loop_pos = source_pos(loop)
    if not any(s.pos > loop_pos for s in steps):
        return
    for site in others:
        if site.inside(loop) and id(site.node) not in reported:
            reported.add(id(site.node))
            method = site.node.func.attr  # type: ignore[attr-defined]
            yield site.node, (f"{key}.{method}() runs every micro-batch, but {key}.step() runs after the "
                              f"accumulation loop; call it once per optimizer step, next to {key}.step()")


def _boundary_if(key: str, backward: Site, loop: ast.AST, steps: list[Site], others: list[Site],
                 reported: set[int]) -> Iterator[Hit]:
    # scaler.step() sits under an accumulation-boundary `if` inside the loop, update/unscale_ do not.
    guarded = [s for s in steps if s.inside(loop) and
               any(not backward.inside(branch) for branch in _boundary_ifs(s, loop))]
    if not guarded:
        return
    for site in others:
        if not site.inside(loop) or _boundary_ifs(site, loop) or id(site.node) in reported:
            continue
        reported.add(id(site.node))
        method = site.node.func.attr  # type: ignore[attr-defined]
        yield site.node, (f"{key}.{method}() runs on every micro-batch while {key}.step() runs only at the "
                          "accumulation boundary; move it under the same boundary condition")


def _visible_scalers(ctx: FileContext, scope: Scope) -> set[str]:
    keys: set[str] = set()
    current: Scope | None = scope
    while current is not None:
        if current is scope or not isinstance(current.node, ast.ClassDef):
            for key, values in current.bindings.items():
                for value in values:
                    call = ctx.scaler_call(value)
                    if call is not None and ctx.scaler_enabled(call) is not False:
                        keys.add(key)
        current = current.parent
    if scope.cls is not None:
        for other in ctx.scopes:
            if other.cls is scope.cls:
                for key, values in other.bindings.items():
                    if key.startswith("self.") and any(ctx.scaler_call(v) is not None for v in values):
                        keys.add(key)
        keys.update(k for k in ctx.scaler_usage_keys if k.startswith("self."))
    keys.update(key for (kind, key) in _events(ctx, scope) if kind == "backward")
    return keys


def _dict_entries(ctx: FileContext, scope: Scope, obj: ast.expr,
                  save: ast.Call) -> list[tuple[str | None, ast.expr]] | None:
    """(key, value) pairs of the saved dict, or None when its content cannot be known."""
    if isinstance(obj, ast.Dict):
        return [(const_str(k) if k is not None else None, v) for k, v in zip(obj.keys, obj.values)]
    if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "dict" and not obj.args:
        return [(kw.arg, kw.value) for kw in obj.keywords]
    if not isinstance(obj, ast.Name):
        return None
    # The binding in force at the save: the last one before it in source order.
    save_pos = source_pos(save)
    values = scope.bindings.get(obj.id, [])
    before = [v for v in values if v is not None and source_pos(v) < save_pos]
    if not before or len(before) < sum(1 for v in values if v is None or source_pos(v) < save_pos):
        return None  # unknown bindings (parameters, loop targets) may be the one in force
    bound = max(before, key=source_pos)
    entries = _dict_entries(ctx, scope, bound, save)
    if entries is None:
        return None
    window = (source_pos(bound), save_pos)
    for site in scope.assigns:  # ckpt["scaler"] = scaler.state_dict()
        stmt = site.node
        if isinstance(stmt, ast.Assign) and window[0] < site.pos < window[1]:
            for target in stmt.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == obj.id):
                    entries.append((const_str(target.slice), stmt.value))
    for site in scope.calls:  # ckpt.update(...), helper(ckpt): the dict escapes, cannot decide
        call = site.node
        if call is save or not window[0] < site.pos < window[1]:
            continue
        assert isinstance(call, ast.Call)
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == obj.id:
            return None
        if any(isinstance(a, ast.Name) and a.id == obj.id for a in (*call.args, *(k.value for k in call.keywords))):
            return None
    return entries


@rule(code="AMP104", name="checkpoint-without-scaler",
      summary="checkpoint saved with model/optimizer state but without the scaler state while a scaler exists",
      needs=(("save(",), ("state_dict",), _SCALER_TOKENS))
def amp104(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        for site in scope.calls:
            call = site.node
            assert isinstance(call, ast.Call)
            if ctx.qualname(call.func) != "torch.save":
                continue
            obj = call_arg(call, 0, "obj")
            if obj is None:
                continue
            entries = _dict_entries(ctx, scope, obj, call)
            if not entries or any(k is None for k, _ in entries):
                continue
            if not any(_has_state_dict(v) for _, v in entries):
                continue
            scalers = _visible_scalers(ctx, scope)
            if not scalers:
                continue
            if any(_mentions_scaler(k, v, scalers) for k, v in entries):
                continue
            name = sorted(scalers)[0]
            yield call, (f"checkpoint has model/optimizer state but not the loss-scaler state; a resumed run "
                         f"restarts at the initial scale and skips steps finding it again; save "
                         f"'scaler': {name}.state_dict() and load it on resume")


def _has_state_dict(value: ast.expr) -> bool:
    return any(isinstance(n, ast.Call) and last_name(n.func) == "state_dict" for n in ast.walk(value))


def _mentions_scaler(key: str | None, value: ast.expr, scalers: set[str]) -> bool:
    if key is not None and ("scal" in key.lower() or "amp" in key.lower()):
        return True
    for node in ast.walk(value):
        node_key = expr_key(node)
        if node_key is not None and (node_key in scalers or "scaler" in node_key.rpartition(".")[2].lower()):
            return True
    return False


@rule(code="AMP111", name="scaler-with-bf16",
      summary="GradScaler used together with bf16 autocast",
      needs=(("GradScaler",), ("autocast",)))
def amp111(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in ctx.scopes:
        regions = ctx.autocast_withs(scope)
        if not regions or any(info.dtype != "bf16" for _, info in regions):
            continue  # no autocast, or an fp16 / undecidable one that does need the scaler
        keys = {key for (kind, key) in _events(ctx, scope) if kind == "backward"}
        for site in scope.calls:
            key = scaled_receiver(site.node)
            if key:
                keys.add(key)
        for key in sorted(keys):
            construction = ctx.scaler_construction(key, scope)
            if construction is None or ctx.scaler_enabled(construction) is not True:
                continue
            if id(construction) in reported:
                continue
            reported.add(id(construction))
            yield construction, ("GradScaler with bfloat16 autocast: bf16 has float32's exponent range and "
                                 "needs no loss scaling; the scaler only adds skipped steps and host syncs; "
                                 "drop it (or enable it only for float16)")


_SCALING_TOKENS = (b"Scaler", b"scaler", b".scale(", b"loss_scale", b"MixedPrecision")


@rule(code="AMP112", name="fp16-without-loss-scaling",
      summary="float16 autocast in a training loop (backward present) with no loss scaling",
      needs=(("autocast",), ("backward",)))
def amp112(ctx: FileContext) -> Iterator[Hit]:
    if any(token in ctx.source for token in _SCALING_TOKENS):
        return  # some loss scaling exists somewhere: cannot tell which path uses it
    for scope in ctx.scopes:
        regions = [(site, info) for site, info in ctx.autocast_withs(scope) if info.dtype == "fp16"]
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


@rule(code="AMP115", name="scheduler-steps-on-skipped-step",
      summary="lr_scheduler.step() called unconditionally right after scaler.step()",
      needs=(("step(",), ("sched", "LR("), _SCALER_TOKENS))
def amp115(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        for site in scope.calls:
            func = site.node.func  # type: ignore[attr-defined]
            if not (isinstance(func, ast.Attribute) and func.attr == "step"):
                continue
            key = expr_key(func.value)
            if not ctx.is_scaler(key, scope):
                continue
            for later in scope.calls:
                if later.frames is not site.frames or later.index <= site.index:
                    continue
                call = later.node
                assert isinstance(call, ast.Call)
                if not (isinstance(later.stmt, ast.Expr) and later.stmt.value is call):
                    continue
                lfunc = call.func
                if (isinstance(lfunc, ast.Attribute) and lfunc.attr == "step" and not call.args
                        and ctx.is_scheduler(expr_key(lfunc.value), scope)):
                    yield call, (f"the learning-rate schedule advances even when {key}.step() skipped the "
                                 "optimizer step (inf/NaN gradients); step the scheduler only when the "
                                 f"step was applied (e.g. if {key}.get_scale() >= scale_before_update)")


@rule(code="AMP116", name="path-skips-scaler-update",
      summary="a control path that skips scaler.update() after scaler.step() / unscale_()",
      needs=(("update(",), ("continue", "break", "return"), _SCALER_TOKENS))
def amp116(ctx: FileContext) -> Iterator[Hit]:
    for scope in ctx.scopes:
        if not scope.jumps:
            continue
        events = _events(ctx, scope)
        reported: set[int] = set()
        for (kind, key), sites in events.items():
            if kind not in ("step", "unscale_") or not ctx.is_scaler(key, scope):
                continue
            updates = events.get(("update", key), [])
            for started in sites:
                loop = started.innermost_loop()
                later = [u for u in updates if u.pos > started.pos and u.innermost_loop() is loop]
                if not later:
                    continue
                update = min(later, key=lambda s: s.pos)
                for jump in scope.jumps:
                    if not (started.pos < jump.pos < update.pos) or id(jump.node) in reported:
                        continue
                    if not _skips(jump, started, update, loop):
                        continue
                    reported.add(id(jump.node))
                    word = ("continue" if isinstance(jump.node, ast.Continue)
                            else "break" if isinstance(jump.node, ast.Break) else "return")
                    yield jump.node, (f"`{word}` after {key}.{kind}() skips {key}.update(): the next "
                                      f"{key}.unscale_()/step() raises and the scale stops adapting; "
                                      f"call {key}.update() on this path too")


def _skips(jump: Site, started: Site, update: Site, loop: ast.AST | None) -> bool:
    if isinstance(jump.node, (ast.Continue, ast.Break)) and (loop is None or jump.innermost_loop() is not loop):
        return False  # it leaves a nested loop, not the one holding the step
    # The jump must be on a path through `started`: not in a sibling branch of one of its ifs/trys.
    for stmt, fld in started.frames:
        for jstmt, jfld in jump.frames:
            if jstmt is stmt and jfld != fld:
                return False
    # update() in a `finally` around the jump still runs.
    for stmt, fld in update.frames:
        if fld == "finalbody" and jump.inside(stmt) and not jump.inside(stmt, "finalbody"):
            return False
    return True


RULES = (amp102, amp103, amp104, amp111, amp112, amp115, amp116)
