"""fp8 rules: torchao's float8 training recipe as its documentation lays it out -- convert, then
shard, then compile; with FSDP2's fp8 all-gather, the weight scales precomputed after each
optimizer step.

Calls are recognised by what they resolve to through the file's imports (``torchao.float8``,
``torchao.float8.float8_linear_utils``, any alias), and by their bare name only when the file does
not import them (a snippet)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator, Set

from ampkit.lint.astutil import call_arg, const_bool, const_str, expr_key
from ampkit.lint.context import FileContext
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope, Site
from ampkit.lint.paths import CALL, ITER, LOOP, Path, build_paths
from ampkit.lint.steps import is_backward_call

__all__ = ["RULES"]

CONVERT = "convert_to_float8_training"
PRECOMPUTE = "precompute_float8_dynamic_scale_for_fsdp"
ALL_GATHER = "enable_fsdp_float8_all_gather"

_ENGINES = frozenset({"ampkit.MixedPrecision", "ampkit.mixed_precision.MixedPrecision", "ampkit.engine.Engine"})
_FP8_PRECISIONS = frozenset({"fp8", "fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp"})
# What a file may use to compile its model: torch.compile itself, model.compile(), a project's own
# helper (apply_compile, compile_model), a config switch (job_config.compile.enable) or a dynamo
# backend (Accelerate's dynamo_backend=).  Any of them keeps AMP117 silent.
_COMPILE_WORD = re.compile(r"(?:^|_)compile(?:_|$)|dynamo", re.IGNORECASE)
# Compilers of something else than a model.
_OTHER_COMPILERS = frozenset({"re.compile", "regex.compile"})


def _torchao(ctx: FileContext, func: ast.AST, name: str) -> bool:
    """True when ``func`` is torchao's ``name`` (any module path or alias), or the bare ``name``
    in a file that does not import it."""
    qualified = ctx.qualname(func)
    if qualified is not None:
        return qualified.startswith("torchao.") and qualified.rpartition(".")[2] == name
    return isinstance(func, ast.Name) and func.id == name


def _is_fully_shard(ctx: FileContext, func: ast.AST) -> bool:
    qualified = ctx.qualname(func)
    if qualified is not None:
        return qualified.startswith("torch.distributed.") and qualified.endswith(".fully_shard")
    return isinstance(func, ast.Name) and func.id == "fully_shard"


def _fp8_engine(ctx: FileContext, call: ast.Call, scope: Scope) -> bool:
    """``ampkit.MixedPrecision(P, ...)`` with ``P`` an fp8 precision (``_FP8_PRECISIONS``: ``"fp8"``,
    ``"fp8-tensorwise"``, ``"fp8-rowwise"``, ``"fp8-rowwise-gw-hp"``), the name given directly or
    through one binding."""
    if ctx.qualname(call.func) not in _ENGINES:
        return False
    precision = call_arg(call, 0, "precision")
    if isinstance(precision, ast.Name):
        precision = ctx.value_of(precision, scope)
    return const_str(precision) in _FP8_PRECISIONS


def _compiles(ctx: FileContext) -> bool:
    """True when the file may compile a model somewhere (see ``_COMPILE_WORD``)."""
    for node in ast.walk(ctx.tree):
        if isinstance(node, ast.Name):
            word = node.id
            if word == "compile" and word not in ctx.flow.imports:
                continue  # Python's builtin compile() compiles source code
        elif isinstance(node, ast.Attribute):
            word = node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            word = node.arg
        else:
            continue
        qualified = ctx.qualname(node)
        if qualified == "torch.compile" or (_COMPILE_WORD.search(word) and qualified not in _OTHER_COMPILERS):
            return True  # torch.compile under any alias, or something named like a compile
    return False


_NO_COMPILE = ("in a file that never calls torch.compile: torchao's float8 layers need compile to fuse their "
               "scaling and casting kernels, and without it fp8 can be slower than bf16")


@rule(code="AMP117", name="fp8-without-compile",
      summary="fp8 training (torchao's convert_to_float8_training, an ampkit fp8 engine) in a file that "
              "never compiles the model",
      needs=((CONVERT, "MixedPrecision", "Engine"), (CONVERT, "fp8"), ("backward",)))
def amp117(ctx: FileContext) -> Iterator[Hit]:
    found: list[Hit] = []
    for scope, site in ctx.calls():
        call = site.node
        assert isinstance(call, ast.Call)
        if _torchao(ctx, call.func, CONVERT):
            found.append((call, f"fp8 conversion {_NO_COMPILE}; compile the converted model: "
                                "model = torch.compile(model)"))
        elif _fp8_engine(ctx, call, scope):
            found.append((call, f"fp8 engine {_NO_COMPILE}; compile the prepared model: "
                                "model = torch.compile(mp.prepare(model))"))
    # The loop that trains is where compile belongs; a helper module that only converts is not
    # judged, nor is a test, which runs eager on purpose (it checks numerics, not speed).
    if found and not _compiles(ctx) and not ctx.is_test_file \
            and any(is_backward_call(ctx, s.node) for _, s in ctx.calls()):  # type: ignore[arg-type]
        yield from found


def _optimizer_step(ctx: FileContext, call: ast.Call, scope: Scope) -> bool:
    """``opt.step()``, or a step given the optimizer (``scaler.step(opt)``, ``mp.step(opt)``)."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "step"):
        return False
    key = expr_key(func.value)
    if ctx.is_scheduler(key, scope):
        return False
    given = call_arg(call, 0, None)
    return ctx.is_optimizer(key, scope) or (given is not None and ctx.is_optimizer(expr_key(given), scope))


def _all_gather_configs(ctx: FileContext) -> Iterator[ast.Call]:
    """Calls that switch torchao's fp8 all-gather on: ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``,
    ``dataclasses.replace(config, enable_fsdp_float8_all_gather=True)``."""
    for _, site in ctx.calls():
        call = site.node
        assert isinstance(call, ast.Call)
        if const_bool(call_arg(call, None, ALL_GATHER)) is True:
            yield call


def _mentions(ctx: FileContext, name: str) -> bool:
    """True when torchao's ``name`` is called or referenced anywhere in the file, under any alias
    (a lambda or an optimizer hook may hold it)."""
    return any((isinstance(node, ast.Attribute) and node.attr == name)
               or (isinstance(node, ast.Name) and _torchao(ctx, node, name)) for node in ast.walk(ctx.tree))


@rule(code="AMP118", name="fp8-all-gather-without-precompute",
      summary="FSDP2 fp8 all-gather (enable_fsdp_float8_all_gather=True) with no "
              "precompute_float8_dynamic_scale_for_fsdp in the file",
      needs=((ALL_GATHER,), ("fully_shard",), ("step(",)))
def amp118(ctx: FileContext) -> Iterator[Hit]:
    configs = list(_all_gather_configs(ctx))
    if not configs or _mentions(ctx, PRECOMPUTE):
        return
    if not any(_is_fully_shard(ctx, site.node.func) for _, site in ctx.calls()):  # type: ignore[attr-defined]
        return
    # The training loop is where the call belongs: a file that builds the config and shards, but
    # steps no optimizer, leaves the loop to another file.
    if not any(_optimizer_step(ctx, site.node, scope) for scope, site in ctx.calls()):  # type: ignore[arg-type]
        return
    for call in configs:
        yield call, ("fp8 all-gather under FSDP2 with no precompute_float8_dynamic_scale_for_fsdp in this file: "
                     "every fp8 weight then reduces its amax in its own all-reduce before each all-gather; call "
                     "precompute_float8_dynamic_scale_for_fsdp(model) right after optimizer.step()")


def _loop_kinds(ctx: FileContext, scope: Scope) -> tuple[dict[int, str], dict[int, ast.AST]]:
    """The precompute / backward / optimizer-step calls of ``scope`` that sit directly in a loop
    holding a precompute: ``id(call) -> kind`` and ``id(call) -> that loop``."""
    loops = {id(loop) for site in scope.calls if _torchao(ctx, site.node.func, PRECOMPUTE)  # type: ignore[attr-defined]
             and (loop := site.innermost_loop()) is not None}
    kinds: dict[int, str] = {}
    where: dict[int, ast.AST] = {}
    if not loops:
        return kinds, where
    for site in scope.calls:
        loop = site.innermost_loop()
        if loop is None or id(loop) not in loops:
            continue  # an inner loop's calls repeat on their own: one iteration here says nothing of them
        call = site.node
        assert isinstance(call, ast.Call)
        if _torchao(ctx, call.func, PRECOMPUTE):
            kind = "precompute"
        elif is_backward_call(ctx, call):
            kind = "backward"
        elif _optimizer_step(ctx, call, scope):
            kind = "step"
        else:
            continue
        kinds[id(call)], where[id(call)] = kind, loop
    return kinds, where


def _among(ids: Set[int]) -> Callable[[Site], bool]:
    """The ``wanted`` of ``build_paths`` that keeps the calls whose ids are in ``ids``."""
    return lambda site: id(site.node) in ids


def _stale_precomputes(path: Path, kinds: dict[int, str], where: dict[int, ast.AST]) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(precompute, step) pairs of one iteration on ``path`` where, going round the loop, the first
    thing after the step is a backward (so a forward ran with the old scales), not a precompute."""
    for loop in {id(n): n for n in where.values()}.values():
        start = next((i for i, ev in enumerate(path) if ev.kind == LOOP and ev.node is loop), None)
        end = next((i for i, ev in enumerate(path) if ev.kind == ITER and ev.node is loop), None)
        if start is None or end is None:
            continue  # the iteration ended in break / return / raise: no next forward
        seq = [ev.node for ev in path[start + 1:end] if ev.kind == CALL and where.get(id(ev.node)) is loop]
        pres = [n for n in seq if kinds[id(n)] == "precompute"]
        if not pres or not any(kinds[id(n)] == "backward" for n in seq):
            continue
        for i, node in enumerate(seq):
            if kinds[id(node)] != "step":
                continue
            after = next(n for n in (*seq[i + 1:], *seq[:i + 1]) if kinds[id(n)] != "step")
            if kinds[id(after)] == "backward":
                for pre in pres:
                    yield pre, node


@rule(code="AMP119", name="fp8-scale-precompute-before-step",
      summary="precompute_float8_dynamic_scale_for_fsdp placed so that the optimizer step follows it "
              "before the next forward",
      needs=((PRECOMPUTE,), ("step(",), ("backward",)))
def amp119(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in ctx.scopes:
        kinds, where = _loop_kinds(ctx, scope)
        if "precompute" not in kinds.values():
            continue
        paths, _ = build_paths(scope, _among(kinds.keys()))
        for path in paths:
            for pre, step in _stale_precomputes(path, kinds, where):
                if id(pre) in reported:
                    continue
                reported.add(id(pre))
                what = ctx.segment(step.func) if isinstance(step, ast.Call) else "optimizer.step"  # type: ignore[attr-defined]
                yield pre, (f"{PRECOMPUTE} runs before {what}() on this loop's path to the next forward: that "
                            "forward all-gathers the updated weights cast with scales of the weights before the "
                            f"update; call it right after {what}()")


def _sharded_key(site: Site) -> str | None:
    """The module ``fully_shard`` shards, as a key; a loop variable stands for what its loop
    iterates (``for block in model.layers: fully_shard(block)`` shards ``model.layers``)."""
    arg = call_arg(site.node, 0, "module")  # type: ignore[arg-type]
    if isinstance(arg, ast.Name):
        for loop in reversed(site.loops()):
            if isinstance(loop, (ast.For, ast.AsyncFor)) and any(
                    isinstance(n, ast.Name) and n.id == arg.id for n in ast.walk(loop.target)):
                return _iterated_key(loop.iter)
    return expr_key(arg) if arg is not None else None


def _iterated_key(node: ast.expr) -> str | None:
    """``model.layers`` for ``model.layers``, ``enumerate(model.layers)``, ``model.layers.values()``."""
    for _ in range(3):
        if not isinstance(node, ast.Call):
            break
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("enumerate", "list", "reversed") and node.args:
            node = node.args[0]
        elif isinstance(func, ast.Attribute) and func.attr in (
                "children", "modules", "named_children", "named_modules", "values", "items"):
            node = func.value
        else:
            return None
    return expr_key(node)


def _related(a: str, b: str) -> bool:
    """One module is the other or holds it (``model`` and ``model.layers``)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _rebound(scope: Scope, key: str, after: Site, before: Site) -> bool:
    """True when ``key`` (or the object holding it) is assigned anew between the two sites, in
    source order: ``module = build()`` after sharding the previous ``module``."""
    for site in scope.assigns:
        if site.stmt is before.stmt or not after.pos < site.pos < before.pos:
            continue
        targets = site.stmt.targets if isinstance(site.stmt, ast.Assign) else [site.stmt.target]  # type: ignore[attr-defined]
        for target in targets:
            bound = expr_key(target)
            if bound is not None and (key == bound or key.startswith(bound + ".")):
                return True
    return False


@rule(code="AMP120", name="fp8-convert-after-fully-shard",
      summary="convert_to_float8_training on a model already sharded with FSDP2's fully_shard",
      needs=((CONVERT,), ("fully_shard",)))
def amp120(ctx: FileContext) -> Iterator[Hit]:
    reported: set[int] = set()
    for scope in ctx.scopes:
        converts = {id(s.node): s for s in scope.calls if _torchao(ctx, s.node.func, CONVERT)}  # type: ignore[attr-defined]
        shards = {id(s.node): s for s in scope.calls if _is_fully_shard(ctx, s.node.func)}  # type: ignore[attr-defined]
        if not converts or not shards:
            continue
        paths, _ = build_paths(scope, _among(converts.keys() | shards.keys()))
        for path in paths:
            sharded: list[tuple[str, Site]] = []
            for ev in path:
                if ev.kind != CALL:
                    continue
                if id(ev.node) in shards:
                    key = _sharded_key(shards[id(ev.node)])
                    if key:
                        sharded.append((key, shards[id(ev.node)]))
                    continue
                target = expr_key(call_arg(ev.node, 0, "module") or ast.Constant(None))  # type: ignore[arg-type]
                done = next((k for k, shard in sharded if target and _related(k, target)
                             and not _rebound(scope, target, shard, converts[id(ev.node)])), None)
                if done is None or id(ev.node) in reported:
                    continue
                reported.add(id(ev.node))
                yield ev.node, (f"{CONVERT}({target}) after fully_shard({done}): torchao converts before FSDP2 "
                                "shards (the float8 weights must be in place when the parameters are sharded, and "
                                "a sharded model fails with \"aten.mm.default got mixed torch.Tensor and DTensor\"); "
                                f"call {CONVERT} first, then fully_shard")


RULES = (amp117, amp118, amp119, amp120)
