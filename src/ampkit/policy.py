"""Per-module precision policy: run chosen modules in fp32 while the rest stays in autocast.

A kept module runs with autocast disabled and its floating-point inputs cast to fp32; its
outputs stay fp32 and the next autocast op casts them down as usual.  Rules are name patterns
(``fnmatch`` on the dotted name from ``named_modules()``) or module types.  Unlike decorating a
whole ``forward`` with ``custom_fwd(cast_inputs=torch.float32)``, which turns autocast off for
every sub-module too, the policy applies to exactly the modules named.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Fp32Policy", "KeepFp32Rule", "check_keep_fp32", "is_kept", "keep_fp32", "release_fp32",
           "resolve_keep_fp32", "rule_names"]

KeepFp32Rule = str | type[nn.Module]

_ATTR = "_ampkit_keep_fp32"


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float32 else value
    if isinstance(value, tuple):
        return tuple(_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


class _Fp32Region:
    """Forward pre-hook + forward hook pair that disables autocast around one module's forward.

    Under ``torch.compile`` the hooks run eagerly (``torch.compiler.disable``): an autocast context
    entered in one hook and left in another cannot be traced.  Dynamo guards on the autocast
    state, so the kept module is compiled as its own fp32 graph; the cost is one graph break
    before and after each kept module.  The hooks are wrapped per region rather than at class
    definition, so that importing ampkit does not import dynamo (about a second).
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._stack: list[torch.autocast] = []
        self.pre_hook = torch.compiler.disable(self._pre_hook)
        self.post_hook = torch.compiler.disable(self._post_hook)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = torch.autocast(device_type=self.device_type, enabled=False)
        ctx.__enter__()
        self._stack.append(ctx)
        return _to_fp32(args), _to_fp32(kwargs)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # Registered with always_call=True, so this runs even when forward raises.
        if self._stack:
            self._stack.pop().__exit__(None, None, None)


def rule_names(rules: Iterable[KeepFp32Rule]) -> list[str]:
    """The rules as strings (a type by its qualified name), for JSON and messages."""
    return [r if isinstance(r, str) else f"{r.__module__}.{r.__qualname__}" for r in rules]


class _Kept:
    """What ``keep_fp32`` leaves on a module: its hook handles and, when an engine's policy applied
    it, that policy (weakly) and its rules, so that a second engine can tell whose hooks they are.

    A deep copy (an EMA or best-model copy) keeps the owner: its hooks are that engine's rules too.
    """

    def __init__(self, handles: list[RemovableHandle], owner: Fp32Policy | None) -> None:
        self.handles = handles
        self.owner: weakref.ReferenceType[Fp32Policy] | None = weakref.ref(owner) if owner is not None else None
        self.rules: list[str] = rule_names(owner.rules) if owner is not None else []

    def owned_by_another(self, policy: Fp32Policy) -> bool:
        return self.owner is not None and self.owner() is not policy

    def __deepcopy__(self, memo: dict[int, Any]) -> _Kept:
        twin = _Kept(copy.deepcopy(self.handles, memo), None)
        twin.owner, twin.rules = self.owner, list(self.rules)
        return twin


def check_keep_fp32(value: Sequence[KeepFp32Rule] | None) -> tuple[KeepFp32Rule, ...]:
    """``keep_fp32=`` as a tuple of rules: None means none; a bare pattern or type raises, naming the list form.

    A bare string would otherwise be iterated as one-letter patterns, and a bare type is not iterable.

    >>> check_keep_fp32(None), check_keep_fp32(["lm_head"])
    ((), ('lm_head',))
    >>> check_keep_fp32("lm_head")
    Traceback (most recent call last):
    ...
    TypeError: keep_fp32='lm_head': give a list of module name patterns or nn.Module types, keep_fp32=['lm_head']
    """
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        shown = repr(value) if isinstance(value, str) else value.__name__
        raise TypeError(f"keep_fp32={shown}: give a list of module name patterns or nn.Module types, "
                        f"keep_fp32=[{shown}]")
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"keep_fp32={value!r} ({type(value).__name__}) is not a list of module name patterns or "
                        "nn.Module types; e.g. keep_fp32=['lm_head', nn.LayerNorm], or None for none") from None


def keep_fp32(module: nn.Module, device_type: str | None = None) -> nn.Module:
    """Run ``module`` in fp32 even inside ``torch.autocast``; returns the module.

    ``device_type`` defaults to the device of the module's first parameter (cpu if it has none).
    Applying it twice is a no-op.

    >>> norm = keep_fp32(nn.LayerNorm(4))
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     norm(torch.randn(2, 4, dtype=torch.bfloat16)).dtype
    torch.float32
    """
    return _keep(module, device_type, None)


def _keep(module: nn.Module, device_type: str | None, owner: Fp32Policy | None) -> nn.Module:
    kept = getattr(module, _ATTR, None)
    if kept is not None:
        if owner is not None and isinstance(kept, _Kept) and kept.owned_by_another(owner):
            # Another engine's module that this one keeps too: this engine owns it from now on.
            kept.owner, kept.rules = weakref.ref(owner), rule_names(owner.rules)
        return module
    if device_type is None:
        param = next(module.parameters(), None)
        device_type = param.device.type if param is not None else "cpu"
    region = _Fp32Region(device_type)
    handles: list[RemovableHandle] = [
        module.register_forward_pre_hook(region.pre_hook, with_kwargs=True),
        module.register_forward_hook(region.post_hook, with_kwargs=True, always_call=True),
    ]
    setattr(module, _ATTR, _Kept(handles, owner))
    return module


def is_kept(module: nn.Module) -> bool:
    """Whether ``module`` runs in fp32 under ``keep_fp32`` (by hand or by an engine's rules).

    >>> m = nn.Linear(2, 2)
    >>> is_kept(m), is_kept(keep_fp32(m))
    (False, True)
    """
    return getattr(module, _ATTR, None) is not None


def release_fp32(module: nn.Module) -> None:
    """Undo ``keep_fp32(module)``."""
    kept = getattr(module, _ATTR, None)
    if kept is None:
        return
    for h in kept.handles:
        h.remove()
    delattr(module, _ATTR)


def resolve_keep_fp32(model: nn.Module, rules: Sequence[KeepFp32Rule], *, what: str = "keep_fp32") -> list[str]:
    """Return the dotted names of ``model``'s modules matched by ``rules``, in model order.

    A rule that matches nothing is almost always a typo, so it raises ``ValueError`` naming the
    closest module names; ``what`` names the argument the rules came from (``fp8_filter`` reuses
    this matcher).
    """
    named = list(model.named_modules())
    chosen: list[str] = []
    for rule in rules:
        hits = [name for name, mod in named if _matches(rule, name, mod, what)]
        if not hits:
            raise ValueError(_no_match_message(rule, [n for n, _ in named if n], what))
        chosen.extend(h for h in hits if h not in chosen)
    order = {name: i for i, (name, _) in enumerate(named)}
    return sorted(chosen, key=order.__getitem__)


def _matches(rule: KeepFp32Rule, name: str, module: nn.Module, what: str = "keep_fp32") -> bool:
    if isinstance(rule, str):
        return fnmatch.fnmatchcase(name, rule)
    if isinstance(rule, type) and issubclass(rule, nn.Module):
        return isinstance(module, rule)
    raise TypeError(
        f"{what} rule {rule!r} is neither a name pattern (str, e.g. 'lm_head' or '*.norm') "
        "nor an nn.Module subclass (e.g. nn.LayerNorm)"
    )


def _no_match_message(rule: KeepFp32Rule, names: Iterable[str], what: str = "keep_fp32") -> str:
    names = list(names)
    if isinstance(rule, str):
        close = difflib.get_close_matches(rule, names, n=5, cutoff=0.4)
        hint = f"closest module names: {close}" if close else f"module names look like: {names[:6]}"
        return f"{what} pattern {rule!r} matches no module of the model; {hint}"
    return f"{what} type {rule.__name__} matches no module of the model"


class Fp32Policy:
    """The keep-fp32 rules of one engine, applied to a model by ``apply(model)``."""

    def __init__(self, rules: Sequence[KeepFp32Rule], device_type: str) -> None:
        self.rules = list(rules)
        self.device_type = device_type
        self.applied: list[str] = []

    def apply(self, model: nn.Module) -> list[str]:
        names = resolve_keep_fp32(model, self.rules) if self.rules else []
        modules = dict(model.named_modules())
        for name in names:
            _keep(modules[name], self.device_type, self)
        self.applied = names
        return names

    def check_unshared(self, model: nn.Module) -> None:
        """Raise when ``model`` has modules kept in fp32 by another engine's policy that this one does not keep.

        Their hooks would stay in force under this engine, whose rules do not say so.  Modules kept
        by hand (``keep_fp32(module)``) are the user's and pass; so do those this policy keeps too.
        """
        mine = set(resolve_keep_fp32(model, self.rules)) if self.rules else set()
        foreign = [(name, kept) for name, m in model.named_modules()
                   if isinstance(kept := getattr(m, _ATTR, None), _Kept) and kept.owned_by_another(self)
                   and name not in mine]
        if not foreign:
            return
        names = [name for name, _ in foreign]
        rules = foreign[0][1].rules
        raise ValueError(
            f"mp.prepare(model): the modules {names[:6]} run in fp32 under keep_fp32={rules} of another engine that "
            f"prepared this model, and this engine (keep_fp32={rule_names(self.rules)}) does not keep them; their "
            "hooks would stay in force. Release them first with that engine's .release(model) (if it is gone: "
            "ampkit.policy.release_fp32(model.get_submodule(name)) for each), or add them to this engine's keep_fp32"
        )

    def release(self, model: nn.Module) -> list[str]:
        """Remove the hooks this policy put on ``model``'s modules; returns their names, in model order."""
        released = []
        for name, m in model.named_modules():
            kept = getattr(m, _ATTR, None)
            if isinstance(kept, _Kept) and kept.owner is not None and kept.owner() is self:
                release_fp32(m)
                released.append(name)
        if released:
            self.applied = [n for n in self.applied if n not in released]
        return released
