"""Loss-scaler order rules, judged on the paths of each function (``ampkit.lint.paths``):
scale → backward → unscale_ → clip → step → update, aligned with the accumulation boundary, with
the scheduler stepped only when the optimizer was, and no path that leaves ``update()`` out.

Each rule reports what happens on *some* path of the function, so exclusive branches (``if
use_amp: ... else: ...``) are never sequenced and a branch re-tested later follows the side it
took the first time."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from ampkit.lint.astutil import expr_key
from ampkit.lint.context import FileContext
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope, Site
from ampkit.lint.paths import BRANCH, END, EXIT, ITER, JUMP, LOOP
from ampkit.lint.steps import (
    SCALER_TOKENS,
    StepEvent,
    is_boundary_test,
    scaled_backward_keys,
    step_event_paths,
)

__all__ = ["RULES"]



def _training_scopes(ctx: FileContext, methods: tuple[str, ...]) -> Iterator[Scope]:
    """Function (and module) scopes that call one of ``methods`` on something, or a scaled backward."""
    for scope in ctx.scopes:
        if isinstance(scope.node, ast.ClassDef):
            continue
        if any(isinstance(f := site.node.func, ast.Attribute) and f.attr in methods  # type: ignore[attr-defined]
               for site in scope.calls) or scaled_backward_keys(ctx, scope):
            yield scope


def _paths(ctx: FileContext, scope: Scope) -> list[list[StepEvent]]:
    return step_event_paths(ctx, scope)


@rule(code="AMP102", name="clip-before-unscale",
      summary="gradient clipping on a path after scaler.scale(loss).backward() with no scaler.unscale_ before it",
      needs=(("clip_grad",), ("scale(",)))
def amp102(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in _training_scopes(ctx, ()):
        unscales = [site for site in scope.calls if isinstance(f := site.node.func, ast.Attribute)  # type: ignore[attr-defined]
                    and f.attr == "unscale_"]
        for events in _paths(ctx, scope):
            scaled: dict[str, Site] = {}  # key -> its backward, for gradients still scaled (in order)
            for ev in events:
                if ev.kind == "backward" and ev.key:
                    scaled.pop(ev.key, None)
                    scaled[ev.key] = ev.event.site  # type: ignore[assignment]
                elif ev.kind in ("unscale_", "update") and ev.key in scaled:
                    del scaled[ev.key]  # type: ignore[arg-type]
                elif ev.kind == "clip" and scaled and id(ev.event.node) not in reported:
                    key, backward = list(scaled.items())[-1]
                    clip = ev.event.site
                    assert clip is not None
                    # An unscale_ written between them but on another branch (`if args.amp:` while the
                    # scaled backward is unconditional) may be correlated in ways the model cannot see.
                    if any(backward.pos < u.pos < clip.pos for u in unscales):
                        continue
                    reported.add(id(ev.event.node))
                    yield ev.event.node, (f"gradients are clipped while still multiplied by the loss scale (after "
                                          f"{key}.scale(...).backward()); call {key}.unscale_(optimizer) before "
                                          "clipping")


def _iterations(events: list[StepEvent]) -> Iterator[tuple[ast.AST, list[StepEvent], int]]:
    """(loop, the events of its iteration on this path, index of the loop's EXIT) per loop left."""
    opened: list[tuple[ast.AST, int]] = []
    for i, ev in enumerate(events):
        if ev.kind == LOOP:
            opened.append((ev.event.node, i))
        elif ev.kind == EXIT and opened and opened[-1][0] is ev.event.node:
            loop, start = opened.pop()
            yield loop, events[start + 1:i], i


def _loop_steps(ctx: FileContext, scope: Scope, loop: ast.AST, key: str) -> bool:
    """True when ``key.step(...)`` is written inside ``loop``."""
    return any(site.inside(loop) and isinstance(f := site.node.func, ast.Attribute)  # type: ignore[attr-defined]
               and f.attr == "step" and expr_key(f.value) == key for site in scope.calls)


@rule(code="AMP103", name="scaler-off-accumulation-boundary",
      summary="scaler.update() / unscale_() on micro-batches where scaler.step() does not run",
      needs=(("scale(",), ("backward",), ("update(", "unscale_(")))
def amp103(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in _training_scopes(ctx, ("unscale_", "update")):
        for events in _paths(ctx, scope):
            for loop, iteration, exit_at in _iterations(events):
                for hit in _off_boundary(ctx, scope, loop, iteration, events[exit_at:]):
                    if id(hit[0]) not in reported:
                        reported.add(id(hit[0]))
                        yield hit


def _off_boundary(ctx: FileContext, scope: Scope, loop: ast.AST, iteration: list[StepEvent],
                  after: list[StepEvent]) -> Iterator[Hit]:
    keys = {ev.key for ev in iteration if ev.kind == "backward" and ev.key}
    for key in sorted(keys):
        if any(ev.kind == "step" and ev.key == key for ev in iteration):
            continue
        others = [ev for ev in iteration if ev.kind in ("unscale_", "update") and ev.key == key]
        if not others:
            continue
        if _loop_steps(ctx, scope, loop, key):
            # The step is in this loop, but this iteration passed an accumulation boundary without it.
            loops = [loop]
            if not any(ev.kind == BRANCH and is_boundary_test(ctx, scope, ev.event.node.test, loops)  # type: ignore[attr-defined]
                       for ev in iteration):
                continue
            for ev in others:
                method = ev.kind
                yield ev.event.node, (f"{key}.{method}() runs on every micro-batch while {key}.step() runs only "
                                      "at the accumulation boundary; move it under the same boundary condition")
        elif any(ev.kind == "step" and ev.key == key for ev in after):
            for ev in others:
                yield ev.event.node, (f"{key}.{ev.kind}() runs every micro-batch, but {key}.step() runs after the "
                                      f"accumulation loop; call it once per optimizer step, next to {key}.step()")


def _scheduler_guard(ctx: FileContext, scope: Scope, test: ast.expr) -> bool:
    """False for a test that only asks whether the scheduler exists (``if scheduler is not None:``)."""
    names = [node for node in ast.walk(test) if isinstance(node, (ast.Name, ast.Attribute, ast.Call))]
    keys = [expr_key(n) for n in names if not isinstance(n, ast.Call)]
    return any(isinstance(n, ast.Call) for n in names) or not any(ctx.is_scheduler(k, scope) for k in keys if k)


@rule(code="AMP115", name="scheduler-steps-on-skipped-step",
      summary="lr_scheduler.step() on a path after scaler.step() with no check that the step was applied",
      needs=(("step(",), ("sched", "LR("), SCALER_TOKENS))
def amp115(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in _training_scopes(ctx, ("step",)):
        for events in _paths(ctx, scope):
            armed: str | None = None  # the scaler stepped, with no test of the outcome since
            for ev in events:
                if ev.kind == "step" and ctx.is_scaler(ev.key, scope):
                    armed = ev.key
                elif ev.kind in (ITER, EXIT) or (ev.kind == BRANCH and not ev.event.forced and _scheduler_guard(
                        ctx, scope, ev.event.node.test)):  # type: ignore[attr-defined]
                    armed = None
                elif ev.kind == "step" and armed and _plain_scheduler_step(ctx, scope, ev):
                    call = ev.event.node
                    if id(call) not in reported:
                        reported.add(id(call))
                        yield call, (f"the learning-rate schedule advances even when {armed}.step() skipped the "
                                     "optimizer step (inf/NaN gradients); step the scheduler only when the "
                                     f"step was applied (e.g. if {armed}.get_scale() >= scale_before_update)")


def _plain_scheduler_step(ctx: FileContext, scope: Scope, ev: StepEvent) -> bool:
    call, site = ev.event.node, ev.event.site
    assert isinstance(call, ast.Call) and site is not None
    return (not call.args and isinstance(site.stmt, ast.Expr) and site.stmt.value is call
            and ctx.is_scheduler(ev.key, scope))


@dataclass
class _Pending:
    """A scaler whose ``unscale_()`` / ``step()`` ran on this path and whose ``update()`` has not yet."""

    kind: str
    site: Site
    branches: list[StepEvent] = field(default_factory=list)
    jump: ast.stmt | None = None


@rule(code="AMP116", name="path-skips-scaler-update",
      summary="a path on which scaler.update() does not run after scaler.step() / unscale_()",
      needs=(("update(",), ("unscale_(", "step("), SCALER_TOKENS))
def amp116(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in _training_scopes(ctx, ("update",)):
        updates: dict[str, list[Site]] = {}  # key -> the update() sites
        for site in scope.calls:
            func = site.node.func  # type: ignore[attr-defined]
            key = expr_key(func.value) if isinstance(func, ast.Attribute) and func.attr == "update" else None
            if key:
                updates.setdefault(key, []).append(site)
        jumps = {id(site.node): site for site in scope.jumps}
        for events in _paths(ctx, scope):
            for node, message in _skipped_updates(ctx, scope, events, updates, jumps):
                if id(node) not in reported:
                    reported.add(id(node))
                    yield node, message


def _skipped_updates(ctx: FileContext, scope: Scope, events: list[StepEvent], updates: dict[str, list[Site]],
                     jumps: dict[int, Site]) -> Iterator[Hit]:
    pending: dict[str, _Pending] = {}
    for ev in events:
        if ev.kind in ("unscale_", "step") and ev.key in updates and ev.key not in pending \
                and ctx.is_scaler(ev.key, scope):
            assert ev.event.site is not None
            pending[ev.key] = _Pending(ev.kind, ev.event.site)  # type: ignore[index]
        elif ev.kind == "update" and ev.key in pending:
            del pending[ev.key]  # type: ignore[arg-type]
        elif ev.kind == BRANCH:
            for p in pending.values():
                p.branches.append(ev)
        elif ev.kind == JUMP:
            for p in pending.values():
                p.jump = ev.event.node  # type: ignore[assignment]
        elif ev.kind in (ITER, EXIT, END):
            for key, p in list(pending.items()):
                hit = _closing(ctx, scope, key, p, ev, updates[key], jumps)
                if hit is not None:
                    del pending[key]
                    yield hit


def _closing(ctx: FileContext, scope: Scope, key: str, p: _Pending, ev: StepEvent, updates: list[Site],
             jumps: dict[int, Site]) -> Hit | None:
    """The hit when ``ev`` closes the region where ``p`` had to be followed by ``key.update()``."""
    jump = p.jump
    if ev.kind == END:
        if isinstance(jump, ast.Return):
            return _jump_hit(key, p, jump)
        return _branch_hit(ctx, scope, key, p, updates)
    loop = ev.event.node
    if not p.site.inside(loop) or not any(u.inside(loop) for u in updates):
        return None
    wanted = ast.Continue if ev.kind == ITER else ast.Break
    if isinstance(jump, wanted) and jumps[id(jump)].innermost_loop() is loop:
        return _jump_hit(key, p, jump)
    return _branch_hit(ctx, scope, key, p, updates) if ev.kind == ITER else None


def _jump_hit(key: str, p: _Pending, jump: ast.stmt) -> Hit:
    word = "continue" if isinstance(jump, ast.Continue) else "break" if isinstance(jump, ast.Break) else "return"
    return jump, (f"`{word}` after {key}.{p.kind}() skips {key}.update(): the next {key}.unscale_()/step() "
                  f"raises and the scale stops adapting; call {key}.update() on this path too")


def _within(branch: ast.If, outer: ast.AST) -> bool:
    """True when ``branch`` is ``outer`` or nested inside it."""
    return branch is outer or any(node is branch for node in ast.walk(outer))


def _branch_hit(ctx: FileContext, scope: Scope, key: str, p: _Pending, updates: list[Site]) -> Hit | None:
    # The branch that left update() out: the last one whose other side holds it.  An accumulation
    # boundary is AMP103's: there the unscale_()/update() outside it is the mistake, not the branch.
    for ev in reversed(p.branches):
        if ev.event.forced:
            continue
        branch = ev.event.node
        assert isinstance(branch, ast.If)
        other = "orelse" if ev.event.taken else "body"
        held = [u for u in updates if u.inside(branch, other)]
        if held and is_boundary_test(ctx, scope, branch.test, held[0].loops()):
            return None
        if held and any(isinstance(f[0], ast.If) and not _within(branch, f[0]) for f in p.site.frames):
            return None  # unscale_/step under another test: the two tests may be correlated
        if held:
            side = "true" if ev.event.taken else "false"
            return branch, (f"when this test is {side}, {key}.update() does not run after {key}.{p.kind}(): the "
                            f"next {key}.unscale_()/step() raises and the scale stops adapting; call "
                            f"{key}.step() and {key}.update() on every path ({key}.step() already skips "
                            "non-finite gradients)")
    return None


RULES = (amp102, amp103, amp115, amp116)
