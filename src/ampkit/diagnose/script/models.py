"""The models service of the script doctor: find the user's models, capture each forward's batch and
the gradient that flowed back into its output, and check normalisation statistics.

Every watcher reads the captures (``WatchState.models``), so this sits below the watchers; the
``Context`` builds it first, switches its model discovery on at install and off at restore.

Costs, per forward of a model (a *root*: a module called while no observed module is running):
one pre-hook and one post-hook call, a copy of the CPU RNG state (about 5 KB), and one
``register_hook`` per output tensor.  The gradient reaching the output is kept by reference
until the optimizer step (memory: one output-sized tensor per micro-batch, capped by
``grad_capture_numel``).  Global module hooks, which put *every* module call on torch's slow
path, are switched on only for sampled steps to discover models; in between, only the roots
carry hooks.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampkit._util.autograd import outputs_reached, sole_cast_consumers
from ampkit._util.modhooks import own_hook
from ampkit._util.threads import PerThread, thread_values
from ampkit._util.trees import leaves
from ampkit.diagnose.script.capture import Capture

__all__ = ["ModelWatch", "is_compile_wrapper"]

_AUTOCAST_DEVICES = tuple(d for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d))


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the ``OptimizedModule`` wrapper of ``torch.compile(module)`` (eager or not).

    >>> is_compile_wrapper(torch._dynamo.disable(nn.Linear(2, 2))), is_compile_wrapper(nn.Linear(2, 2))
    (True, False)
    """
    # Called by the model watcher's global hooks: a dict lookup instead of importing dynamo (about a
    # second) into runs that never compile; without dynamo loaded no wrapper can exist.
    frames = sys.modules.get("torch._dynamo.eval_frame")
    return frames is not None and isinstance(module, frames.OptimizedModule)


@dataclass
class _Root:
    model: nn.Module
    """Held strongly until the doctor's report is built (the script's namespace is gone by then)."""
    device: torch.device
    param_dtype: torch.dtype | None
    handles: list[Any]
    label: str
    """The name the script gives the model (its variable), else its class name."""
    running: list[torch.Tensor]
    """Its normalisation layers' running statistics (snapshotted before each forward)."""


class ModelWatch:
    """Roots, their captures for the current optimizer window, and norm-statistics checks.

    ``on_root_forward(capture)`` is called for every root forward (the AMP observer checks the
    autocast state there); ``max_captures`` bounds how many micro-batches of one window are kept.
    A thread that trains has its own forward in progress, window of captures and step (``PerThread``).
    A forward that ran in another thread (an executor's worker, a plain thread) whose loss is
    backpropagated here joins this thread's window at that backward (``window``).
    """

    captures: PerThread[list[Capture]] = PerThread(list)
    """This thread's forwards of the current optimizer window (cleared by ``new_window``)."""
    _stack: PerThread[list[nn.Module]] = PerThread(list)
    _pending: PerThread[Capture | None] = PerThread(lambda: None)
    step = PerThread(lambda: 1)
    """The optimizer step this thread's next forward belongs to, counted from 1 (``WatchState.step``)."""
    paused = PerThread(bool)
    """True while the doctor itself runs models (replays) in this thread: its hooks then do nothing."""

    def __init__(self, *, on_root_forward: Callable[[Capture], None], locate: Callable[[], str | None],
                 user_frame: Callable[[], types.FrameType | None] = lambda: None,
                 max_captures: int = 8, grad_capture_numel: int = 1 << 24,
                 on_root_enter: Callable[[], None] = lambda: None) -> None:
        self._on_root_enter = on_root_enter
        """Called as a root forward starts (outside any torch function: the loss-side tape leaves the stack)."""
        self._locate = locate
        self._user_frame = user_frame
        self._on_root_forward = on_root_forward
        self.max_captures = max_captures
        self.grad_capture_numel = grad_capture_numel
        self.roots: dict[int, _Root] = {}
        self.last: Capture | None = None
        self._global: list[Any] = []
        self._global_lock = threading.Lock()
        self._windows: dict[int, tuple[threading.Thread, list[Capture]]] = {}
        """Each thread's window (the ``captures`` list object) by thread ident, registered when it gets its
        first capture; kept after the thread ended (a plain thread's forward, joined before the backward)
        until the next backward took what feeds it (``window``)."""

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
        self._stack.clear()
        self.set_discovery(False)
        for root in self.roots.values():
            for h in root.handles:
                h.remove()
            root.handles = []

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
            self._add_root(module)
            self._root_pre(module, args)
            return
        self._stack.append(module)

    def _global_post(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        # (kwargs, out) normally; torch passes only (out) when the forward raised.
        if torch.compiler.is_compiling() or self.paused or id(module) in self.roots or is_compile_wrapper(module):
            return
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _add_root(self, module: nn.Module) -> None:
        device, dtype = _device_and_dtype(module)
        handles = [
            module.register_forward_pre_hook(own_hook(module, self._root_pre)),
            module.register_forward_hook(own_hook(module, self._root_post), with_kwargs=True, always_call=True),
        ]
        self.roots[id(module)] = _Root(module, device, dtype, handles, self._label(module), _running_stats(module))

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

    def refresh_roots(self) -> None:
        """Re-read each root's device and parameter dtype (after ``model.to(...)`` / ``.half()``)."""
        for root in self.roots.values():
            root.device, root.param_dtype = _device_and_dtype(root.model)
            root.running = _running_stats(root.model)

    @property
    def in_forward(self) -> bool:
        """Whether a watched model's forward is running (its ops are the model's, not the loss code's)."""
        return bool(self._stack)

    def _root_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.compiler.is_compiling() or self.paused:
            return
        if self._stack:
            self._stack.append(module)
            return
        self._on_root_enter()
        self._stack.append(module)
        root = self.roots.get(id(module))
        if root is None:  # pragma: no cover - hooks are only on known roots
            return
        dev = root.device.type
        enabled = dev in _AUTOCAST_DEVICES and torch.is_autocast_enabled(dev)
        others = () if enabled else tuple(d for d in _AUTOCAST_DEVICES if d != dev and torch.is_autocast_enabled(d))
        rng_dev = torch.cuda.get_rng_state(root.device) if dev == "cuda" else None
        cap = Capture(
            root=module, args=(), kwargs={}, step=self.step, device=root.device, param_dtype=root.param_dtype,
            autocast_enabled=enabled,
            autocast_dtype=torch.get_autocast_dtype(dev) if dev in _AUTOCAST_DEVICES else torch.float32,
            other_autocast=others, rng_cpu=torch.get_rng_state(), rng_device=rng_dev, location=self._locate(),
            grad_enabled=torch.is_grad_enabled(), training=module.training,
            # A skipped step does not undo its forward's running-stat update; the replay needs the
            # statistics from before it.  One fused copy (multi-tensor kernel) of the stats buffers.
            running_before=(root.running, list(torch._foreach_mul(root.running, 1.0))) if root.running else None,
        )
        thread_values(self)._pending = cap  # no Python frame: this runs on every forward

    def _root_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if torch.compiler.is_compiling() or self.paused or not _pop_to(self._stack, module):
            return
        if self._stack:
            return
        mine = thread_values(self)
        cap, mine._pending = mine._pending, None
        if cap is None or cap.root is not module:
            return
        cap.args, cap.kwargs = args, dict(kwargs)
        budget = self.grad_capture_numel
        for x in leaves(out):
            if isinstance(x, torch.Tensor) and not x.requires_grad and x.is_floating_point():
                cap.untracked_outputs.append(x.detach())  # a reference, not a copy: no cost in the hot path
            elif isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
                i = len(cap.outputs)
                cap.outputs.append(x.detach())
                cap.grad_fns.append(x.grad_fn)
                cap.grads.append(None)
                cap.grads_fp32.append(None)
                if x.numel() <= budget:
                    budget -= x.numel()
                    x.register_hook(_GradSink(cap, i))
        for old in self.captures:
            if old.root is module:
                old.grad_fns = []  # a new micro-batch: do not pin the previous forward's graph
        self._keep(cap)
        self.last = cap
        self._on_root_forward(cap)

    def on_autocast_enter(self, device_type: str, dtype: torch.dtype, marker: Any) -> None:
        """Framework code entered an enabled autocast: when a root forward that started with autocast
        off for its device is running, that forward runs under it (Accelerate's wrapped forward)."""
        cap = self._pending
        if cap is None or self.paused or cap.autocast_enabled or device_type != cap.device.type:
            return
        cap.autocast_enabled, cap.autocast_dtype = True, dtype
        cap.other_autocast = ()
        cap.entered_inside.append(marker)

    # -- backward -----------------------------------------------------------------------------
    def on_backward(self, tensors: list[torch.Tensor], loss: torch.Tensor, scale: torch.Tensor | None) -> list[Capture]:
        """Attach the (unscaled) loss to this window's captures that have none (other threads' that feed
        ``tensors`` included, ``window``) and return them; hook each cast that is an output's sole consumer
        on the way from ``tensors``, to keep the pre-cast gradient (``ampkit._util.autograd.sole_cast_consumers``)."""
        fresh = self.window(tensors)
        if not fresh or not tensors:
            return fresh
        for c in fresh:
            c.loss = loss.detach()
            c.scale = scale
        targets: dict[Any, tuple[Capture, int]] = {}
        for c in fresh:
            for i, fn in enumerate(c.grad_fns):
                if fn is not None:
                    targets[fn] = (c, i)
            c.grad_fns = []
        for out_node, cast in sole_cast_consumers([t.grad_fn for t in tensors], targets).items():
            cap, i = targets[out_node]
            cast.register_prehook(_PreCastSink(cap, i))
        return fresh

    def window(self, tensors: list[torch.Tensor]) -> list[Capture]:
        """This thread's captures not yet backpropagated, after taking over those of other threads whose
        outputs ``tensors`` (a loss) depends on: a model's forward run in a worker thread (a
        ``ThreadPoolExecutor``'s, created before the doctor or after, reused across submits; a plain
        thread's) belongs to the step of the thread that backpropagates its loss and steps.  Cost: a scan
        of the other threads' windows; only when one holds a forward awaiting backward, a walk of the
        loss-side graph (``outputs_reached``, at most 1024 nodes)."""
        me = threading.get_ident()
        foreign: dict[Any, tuple[Capture, list[Capture]]] = {}
        ended: list[tuple[int, threading.Thread]] = []
        others = len(self._windows) - (me in self._windows)  # usually 0: one thread forwards and steps
        for ident, (thread, window) in list(self._windows.items()) if others else ():
            if ident == me:
                continue
            for cap in list(window):
                if cap.loss is None:
                    foreign.update((fn, (cap, window)) for fn in cap.grad_fns if fn is not None)
            if not thread.is_alive():
                ended.append((ident, thread))
        if foreign:
            # The walk also stops at this thread's own outputs, so it never enters a model's graph.
            own = {fn for cap in self.captures for fn in cap.grad_fns if fn is not None}
            reached = outputs_reached([t.grad_fn for t in tensors], foreign.keys() | own)
            for cap, window in {id(foreign[fn][0]): foreign[fn] for fn in reached if fn in foreign}.values():
                with contextlib.suppress(ValueError):  # its own thread let it go meanwhile
                    window.remove(cap)
                    cap.step = self.step
                    self._keep(cap)
        for ident, thread in ended:  # what this backward did not take from a thread that ended, none will
            if self._windows.get(ident, (None,))[0] is thread:
                del self._windows[ident]
        return [c for c in self.captures if c.loss is None]

    def _keep(self, cap: Capture) -> None:
        """Add ``cap`` to this thread's window (the oldest goes beyond ``max_captures``)."""
        window = self.captures
        if not window:  # once per window: a thread's list object stays the same (new_window clears it)
            self._windows[threading.get_ident()] = (threading.current_thread(), window)
        if len(window) >= self.max_captures:
            window.pop(0)
        window.append(cap)

    def new_window(self) -> None:
        """The optimizer stepped: the captured batches belong to the past."""
        self.captures.clear()

    # -- normalisation statistics -----------------------------------------------------------
    def norm_stats(self) -> list[tuple[nn.Module, torch.Tensor]]:
        """``(module, non-finite count)`` for every module with running statistics (device scalars)."""
        out: list[tuple[nn.Module, torch.Tensor]] = []
        for model in self.models():
            for mod in model.modules():
                if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats:
                    bufs = [b for b in (mod.running_mean, mod.running_var) if b is not None]
                    if bufs:
                        out.append((mod, torch.stack([(~torch.isfinite(b)).sum() for b in bufs]).sum()))
        return out


class _GradSink:
    __slots__ = ("cap", "i")

    def __init__(self, cap: Capture, i: int) -> None:
        self.cap, self.i = cap, i

    def __call__(self, grad: torch.Tensor) -> None:
        self.cap.grads[self.i] = grad


class _PreCastSink:
    __slots__ = ("cap", "i")

    def __init__(self, cap: Capture, i: int) -> None:
        self.cap, self.i = cap, i

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        g = grad_outputs[0] if grad_outputs else None
        if g is not None:
            self.cap.grads_fp32[self.i] = g


def _pop_to(stack: list[nn.Module], module: nn.Module) -> bool:
    """Pop ``stack`` down to and including ``module``; False (nothing popped) when it is not on it.  A
    submodule left on top had its post-hook removed mid-forward (another thread switched discovery off)."""
    if stack and stack[-1] is module:  # the usual case: no generator, no scan
        stack.pop()
        return True
    if not any(m is module for m in stack):
        return False
    while stack.pop() is not module:
        pass
    return True


def _running_stats(module: nn.Module) -> list[torch.Tensor]:
    out = []
    for mod in module.modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats:
            out += [b for b in (mod.running_mean, mod.running_var) if b is not None and b.is_floating_point()]
    return out


def _device_and_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype | None]:
    for p in module.parameters():
        return p.device, p.dtype if p.is_floating_point() else None
    for b in module.buffers():
        return b.device, None
    return torch.device("cpu"), None
