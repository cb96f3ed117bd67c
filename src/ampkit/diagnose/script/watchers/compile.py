"""The compile watcher: ``torch.compile`` under the doctor records the call and runs eagerly.

The doctor's observers (module hooks, ``TorchDispatchMode`` in replays) see nothing inside
compiled code, so while a script runs under the doctor ``torch.compile`` (and what calls it:
``nn.Module.compile()``, ``torch.compiler.compile``, the ``@torch.compile`` decorator with or
without options) returns the callable with dynamo disabled (``torch._dynamo.disable``):

* a module becomes the same ``OptimizedModule`` wrapper a real compile returns (``_orig_mod``,
  ``state_dict()`` keys with the ``_orig_mod.`` prefix), whose forward runs the original module
  eagerly.  The models service looks through the wrapper, so module names are those of the
  eager model (``script.models.is_compile_wrapper``);
* a function (a compiled train step, ``model.compile()``'s ``_call_impl``) runs eagerly.

Each call is recorded with the user's line, what was compiled and its options, and reported
(the ``compiled`` key of the doctor's JSON, a line in the terminal).  The step is thus diagnosed
with the inputs and weights the compiled run would have had; ``ampkit doctor --compare-compiled``
measures where the compiled code's numerics differ from eager.  Cost: one Python call per
``torch.compile`` call, and no compilation at all.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher

__all__ = ["CompileCall", "CompileWatch"]

_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options")


@dataclass
class CompileCall:
    """One ``torch.compile`` call of the script."""

    location: str | None
    """The user's ``file:line`` of the call (``model.compile()`` included)."""
    kind: str
    """``module`` (``torch.compile(model)``), ``method`` (``model.compile()``) or ``function``."""
    target: str
    """The module's class name, or the function's qualified name."""
    options: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments given (``mode``, ``backend``, ...), as passed."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form: options rendered as text (a backend may be a callable)."""
        opts = {k: v if isinstance(v, (bool, int, float, str, type(None))) else _name(v)
                for k, v in self.options.items()}
        return {"location": self.location, "kind": self.kind, "target": self.target, "options": opts}


class CompileWatch(Watcher):
    """Replaces ``torch.compile`` while the script runs; ``calls`` lists what the script compiled."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self.calls: list[CompileCall] = []

    @override
    def install(self, patches: PatchSet) -> None:
        patches.replace(torch, "compile", self._compile)

    def _compile(self, model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): a decorator
            return lambda fn: self._compile(fn, **options)
        if options.get("disable"):
            return model  # torch.compile(..., disable=True) compiles nothing and returns its argument
        self.calls.append(CompileCall(self.state.frames.caller(), *_describe(model),
                                      {k: v for k, v in options.items() if k in _OPTIONS}))
        # Dynamo traces frames, not objects: disabling it for the callable runs the same code eagerly,
        # with the doctor's hooks and dispatch modes live, and keeps the wrapper type of a real compile.
        return torch._dynamo.disable(model)

    def module_options(self) -> dict[str, Any]:
        """The options of the script's first module compile, to compile the same way when comparing."""
        first = next((c for c in self.calls if c.kind in ("module", "method")), None)
        return {} if first is None else dict(first.options)


def _describe(model: Any) -> tuple[str, str]:
    if isinstance(model, nn.Module):
        return "module", type(model).__name__
    owner = getattr(model, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(model, "__name__", "") == "_call_impl":
        return "method", type(owner).__name__
    return "function", _name(model)


def _name(obj: Any) -> str:
    """A callable's qualified name (``train_step``, ``Trainer.step``), else its type's name."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(name, str):
        return name
    return type(obj).__name__ if not inspect.isclass(obj) else obj.__name__
