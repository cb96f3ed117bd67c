"""The models service of the script doctor: find the user's models, capture each forward's batch and
the gradient that flowed back into its output.

Every watcher reads the captures (``RunState.models``), so this sits below the watchers; the
``Context`` builds it first, switches its model discovery on at install and off at restore.

Costs, per forward of a model (a *root*: a module called while no observed module is running): those
of ``diagnose.capture`` (its module docstring gives them, and the memory kept).  Global module hooks,
which put *every* module call on torch's slow path, are switched on only for sampled steps to discover
models; in between, only the roots carry hooks.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.diagnose.capture import Capture, CaptureHooks

__all__ = ["ModelWatch", "is_compile_wrapper"]


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the ``OptimizedModule`` wrapper of ``torch.compile(module)`` (eager or not).

    >>> is_compile_wrapper(torch._dynamo.disable(nn.Linear(2, 2))), is_compile_wrapper(nn.Linear(2, 2))
    (True, False)
    """
    # Called by the model watcher's global hooks: a dict lookup instead of importing dynamo (about a
    # second) into runs that never compile; without dynamo loaded no wrapper can exist.
    frames = sys.modules.get("torch._dynamo.eval_frame")
    return frames is not None and isinstance(module, frames.OptimizedModule)


class ModelWatch(CaptureHooks):
    """Roots found by discovery, their captures for the current optimizer window (``CaptureHooks``: the
    per-thread windows, a worker thread's forward joining the thread that backpropagates it) and their
    names.

    ``on_root_forward(capture)`` is called for every root forward (the AMP observer checks the
    autocast state there); ``max_captures`` bounds how many micro-batches of one window are kept.
    ``step`` is the optimizer step this thread's next forward belongs to (``RunState.step``).
    """

    def __init__(self, *, on_root_forward: Callable[[Capture], None], locate: Callable[[], str | None],
                 user_frame: Callable[[], types.FrameType | None] = lambda: None,
                 max_captures: int = 8, grad_capture_numel: int = 1 << 24,
                 on_root_enter: Callable[[], None] = lambda: None) -> None:
        super().__init__(on_root_forward=on_root_forward, locate=locate, on_root_enter=on_root_enter,
                         max_captures=max_captures, grad_capture_numel=grad_capture_numel)
        self._user_frame = user_frame
        self._global: list[Any] = []
        self._global_lock = threading.Lock()

    # -- installation ----------------------------------------------------------------------
    def set_discovery(self, on: bool) -> None:
        """Switch the global module hooks (every module call) on or off; only between this thread's forwards
        (another thread's forward in progress copes: ``_root_post`` pops its stack down to the root).
        Called every step: a switch already in place returns before the lock (checked again under it)."""
        if on == bool(self._global):
            return
        with self._global_lock:
            self._switch_discovery(on)

    def _switch_discovery(self, on: bool) -> None:
        if self._stack or on == bool(self._global):
            return
        if on:
            self._global = [
                nn.modules.module.register_module_forward_pre_hook(self._global_pre),
                nn.modules.module.register_module_forward_hook(self._global_post, with_kwargs=True,
                                                               always_call=True),
            ]
        else:
            for h in self._global:
                h.remove()
            self._global = []

    def remove(self) -> None:
        super().remove()
        self.set_discovery(False)

    def models(self) -> list[nn.Module]:
        return [r.model for r in self.roots.values()]

    def named_modules(self) -> dict[int, str]:
        """``id(module) -> dotted name``: ``model.named_modules()`` names when the script has one model
        (``""`` is the model itself); with several, prefixed by each model's label (``critic.0``)."""
        names: dict[int, str] = {}
        for root in self.roots.values():
            for name, mod in root.model.named_modules():
                names.setdefault(id(mod), self._qualified(root.model, name))
        return names

    def qualify(self, root: nn.Module, name: str | None) -> str | None:
        """A module name relative to ``root``, as reported (see ``named_modules``)."""
        return None if name is None else self._qualified(root, name)

    def _qualified(self, root: nn.Module, name: str) -> str:
        if len(self.roots) <= 1:
            return name
        label = self.label(root)
        return f"{label}.{name}" if name else label

    def label(self, module: nn.Module) -> str:
        root = self.roots.get(id(module))
        return root.label if root is not None else type(module).__name__

    def param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for model in self.models():
            for name, p in model.named_parameters():
                names.setdefault(id(p), name)
        return names

    # -- hooks -----------------------------------------------------------------------------
    def _global_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # Inside a torch.compile region the hooks are traced, not run: they must be no-ops there
        # (the compiled module's own call, which runs eagerly, is the one observed).
        if torch.compiler.is_compiling() or self.paused or id(module) in self.roots or is_compile_wrapper(module):
            return  # its own hooks run; a torch.compile wrapper is looked through (its module is the model)
        if not self._stack:
            if next(module.parameters(), None) is None:
                return  # a loss module or a container without weights is not a model
            self.add_root(module, self._label(module))
            self._root_pre(module, args)
            return
        self._stack.append(module)

    def _global_post(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        # (kwargs, out) normally; torch passes only (out) when the forward raised.
        if torch.compiler.is_compiling() or self.paused or id(module) in self.roots or is_compile_wrapper(module):
            return
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _label(self, module: nn.Module) -> str:
        """How the script names ``module``: the variable holding it (``model``), or the attribute path
        from a variable holding a parent (``model.image_proj``); else its class name.  A variable holding
        its ``torch.compile`` wrapper names it too.  One stack walk and one ``named_modules`` per
        candidate parent, once per root."""
        frame = self._user_frame()
        while frame is not None:
            scopes = (frame.f_locals, frame.f_globals)
            for scope in scopes:
                for name, value in list(scope.items()):
                    if (value is module or (isinstance(value, nn.Module) and is_compile_wrapper(value)
                                            and value._orig_mod is module)) \
                            and not name.startswith("_") and name != "self":
                        return str(name)
            for scope in scopes:
                for name, value in list(scope.items()):
                    if isinstance(value, nn.Module) and not name.startswith("_") and name != "self":
                        for path, sub in value.named_modules():
                            if sub is module and path:
                                return f"{name}.{path.removeprefix('_orig_mod.')}"
            frame = frame.f_back
        return type(module).__name__
