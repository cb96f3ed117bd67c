"""The loss scaler in checkpoints (AMP104): a checkpoint that saves model and optimizer state but
not the scaler's, while an enabled scaler exists.  The saved object is followed through a dict
literal or ``dict(...)``, a name bound to one (with ``ckpt["k"] = v`` additions), ``asdict()`` of a
dataclass of the same file, a method of the same class or a function of the same file that builds
and returns the dict, and from a function that saves its parameter to each call of it in the file
(reported at that call, where the dict is built)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampkit.lint.astutil import call_arg, const_str, expr_key, last_name, source_pos
from ampkit.lint.context import FileContext
from ampkit.lint.core import Hit, rule
from ampkit.lint.flow import Scope
from ampkit.lint.steps import SCALER_TOKENS, scaled_backward_keys

__all__ = ["RULES"]


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
    keys.update(scaled_backward_keys(ctx, scope))
    return keys


def _dict_entries(ctx: FileContext, scope: Scope, obj: ast.expr,
                  save: ast.AST) -> list[tuple[str | None, ast.expr]] | None:
    """(key, value) pairs of the saved dict, or None when its content cannot be known."""
    if isinstance(obj, ast.Dict):
        return [(const_str(k) if k is not None else None, v) for k, v in zip(obj.keys, obj.values)]
    if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "dict" and not obj.args:
        return [(kw.arg, kw.value) for kw in obj.keywords]
    if isinstance(obj, ast.Call):
        return _built_entries(ctx, scope, obj)
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


def _built_entries(ctx: FileContext, scope: Scope, call: ast.Call) -> list[tuple[str | None, ast.expr]] | None:
    """Entries of a checkpoint built by ``asdict(state)``, a dataclass of this file, or a method of
    the same class or a module-level function of this file that returns a dict (``self._checkpoint()``,
    ``make_checkpoint(model, opt)``); None for any other call."""
    if last_name(call.func) == "asdict" and len(call.args) == 1:
        return _dict_entries(ctx, scope, call.args[0], call)
    name = last_name(call.func)
    for other in ctx.scopes:
        node = other.node
        if isinstance(node, ast.ClassDef) and node.name == name and isinstance(call.func, ast.Name) \
                and any(last_name(d.func if isinstance(d, ast.Call) else d) == "dataclass" for d in node.decorator_list):
            return _dataclass_entries(node, call)
        same_class = other.cls is not None and other.cls is scope.cls and expr_key(call.func) == f"self.{name}"
        module_level = isinstance(call.func, ast.Name) and other.parent is not None and other.parent.parent is None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name and (same_class or module_level):
            returns = [site.node.value for site in other.jumps if isinstance(site.node, ast.Return)]
            if not returns or any(r is None for r in returns):
                return None
            found: list[tuple[str | None, ast.expr]] = []
            for value in returns:
                entries = _dict_entries(ctx, other, value, value)  # type: ignore[arg-type]
                if entries is None:
                    return None
                found.extend(entries)
            return found
    return None


def _dataclass_entries(cls: ast.ClassDef, call: ast.Call) -> list[tuple[str | None, ast.expr]] | None:
    fields = [(stmt.target.id, stmt) for stmt in cls.body
              if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)]
    if any(isinstance(a, ast.Starred) for a in call.args) or any(kw.arg is None for kw in call.keywords):
        return None
    passed: dict[str, ast.expr] = {name: arg for (name, _), arg in zip(fields, call.args)}
    passed.update({kw.arg: kw.value for kw in call.keywords if kw.arg})
    # A field left at its default is saved too: its annotation stands for its value.
    return [(name, passed.get(name, stmt.value or stmt.annotation)) for name, stmt in fields]


@rule(code="AMP104", name="checkpoint-without-scaler",
      summary="checkpoint saved with model/optimizer state but without the scaler state while a scaler exists",
      needs=(("save(",), ("state_dict",), SCALER_TOKENS))
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
            for where, built_in, saved in [(call, scope, obj), *_callers_passing(ctx, scope, obj)]:
                message = _missing_scaler(ctx, built_in, saved, where)
                if message is not None:
                    yield where, message


def _missing_scaler(ctx: FileContext, scope: Scope, obj: ast.expr, at: ast.AST) -> str | None:
    """AMP104's message when ``obj`` (saved at ``at``, in ``scope``) holds model or optimizer state but not
    the state of a loss scaler visible there; None when it has it, or its content is unknown."""
    entries = _dict_entries(ctx, scope, obj, at)
    if not entries or any(k is None for k, _ in entries) or not any(_has_state_dict(v) for _, v in entries):
        return None
    scalers = _visible_scalers(ctx, scope)
    if not scalers or any(_mentions_scaler(k, v, scalers) for k, v in entries):
        return None
    return (f"checkpoint has model/optimizer state but not the loss-scaler state; a resumed run restarts at the "
            f"initial scale and skips steps finding it again; save 'scaler': {sorted(scalers)[0]}.state_dict() "
            "and load it on resume")


def _callers_passing(ctx: FileContext, scope: Scope, obj: ast.expr) -> Iterator[tuple[ast.Call, Scope, ast.expr]]:
    """``(call, its scope, the argument)`` for each call, in this file, of the module-level function
    ``scope`` whose parameter ``obj`` it saves: the checkpoint is built in the caller (``save(state, path)``)."""
    node = scope.node
    if not (isinstance(obj, ast.Name) and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and scope.parent is not None and scope.parent.parent is None):
        return
    params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    if obj.id not in params or scope.bindings.get(obj.id, [None]) != [None]:
        return  # not a parameter, or rebound in the function
    index = params.index(obj.id)
    for caller, site in ctx.calls():
        call = site.node
        assert isinstance(call, ast.Call)
        if isinstance(call.func, ast.Name) and call.func.id == node.name:
            arg = call_arg(call, index, obj.id)
            if arg is not None:
                yield call, caller, arg


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


RULES = (amp104,)
