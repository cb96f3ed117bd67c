"""One forward of a model, kept to replay it: ``Capture``, and ``CaptureHooks``, which fill captures.

Every doctor that replays a step builds on these: the live doctor (``live.doctor.ReplayDoctor``) and the
script doctor's model service (``script.models.ModelWatch``, which adds model discovery on top).

Costs, per forward of a hooked model (a *root*; a root called inside another root's forward is part of
the outer one's replay and is not captured again): one pre-hook and one post-hook call, a copy of the CPU
RNG state (about 5 KB; on CUDA also the generator's state), one fused copy of the model's running
statistics (multi-tensor kernel; a skipped step does not undo its forward's update, and the replay must
start from the statistics before it), and one ``register_hook`` per output.  Inputs, outputs and the
gradients that reach the outputs are kept by reference, never copied: an input buffer the training code
overwrites in place is seen with its new contents at replay time.  The gradient before a narrowing cast
(``.float()`` before the loss, autocast's fp32 loss ops) is kept too, through a pre-hook on the cast's
autograd node found at backward (``_util.autograd.sole_cast_consumers``): a scale that overflows fp16
exactly at that boundary is then replayed faithfully.  Memory: one output-sized gradient per forward,
bounded by ``grad_capture_numel`` (None: unbounded) and by ``max_captures`` forwards per window.

A thread that trains has its own forward in progress, window of captures and step (``PerThread``).  A
forward run in another thread (an executor's worker, a plain thread) whose loss is backpropagated here
joins this thread's window at that backward (``window``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit._util.autograd import outputs_reached, sole_cast_consumers
from ampkit._util.modhooks import own_hook
from ampkit._util.threads import PerThread, thread_values
from ampkit._util.trees import leaves
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["Capture", "CaptureHooks", "Root", "running_stats"]

_AUTOCAST_DEVICES = tuple(d for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d))


@dataclass(eq=False)
class Capture:
    """One forward call of a root model, enough to replay it.

    Compared by identity: each is one event, and a field-by-field comparison would ask tensors for
    their truth (a window's ``list.remove`` compares the captures it passes on the way)."""

    root: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    step: int
    device: torch.device
    param_dtype: torch.dtype | None
    autocast_enabled: bool
    """Autocast was on for the model's own device type during this forward."""
    autocast_dtype: torch.dtype
    other_autocast: tuple[str, ...]
    """Device types with autocast on while the model's own device type had it off."""
    rng_cpu: torch.Tensor
    rng_device: torch.Tensor | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    """The floating outputs that require grad, detached (holding them keeps no graph alive)."""
    untracked_outputs: list[torch.Tensor] = field(default_factory=list)
    """The floating outputs that do not require grad (a frozen teacher under ``torch.no_grad``): checked
    for finiteness with the others, since a non-finite one can make the loss non-finite first."""
    grad_fns: list[Any] = field(default_factory=list)
    """Their autograd nodes, kept only until their backward (or the model's next forward)."""
    grads: list[torch.Tensor | None] = field(default_factory=list)
    """Gradient flowing into each output during the user's backward (as autograd delivered it)."""
    grads_fp32: list[torch.Tensor | None] = field(default_factory=list)
    """The same gradient before a cast to the output's low-precision dtype, when a cast consumed it."""
    location: str | None = None
    """The user's line that called the model."""
    running_before: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """(running-stat buffers, their values before this forward)."""
    loss: torch.Tensor | None = None
    """The unscaled loss the user backpropagated after this forward."""
    scale: torch.Tensor | float | None = None
    """The factor the captured gradients carry (the loss scale; the live doctor also divides it by the
    accumulation steps), or None when the loss was not scaled."""
    grad_enabled: bool = True
    """Autograd was recording during this forward (False under ``torch.no_grad``/``inference_mode``)."""
    training: bool = True
    """The model was in train mode (``model.eval()`` sets False)."""
    entered_inside: list[Any] = field(default_factory=list)
    """Markers of the framework autocast that this forward entered itself (Accelerate wraps
    ``model.forward`` in one): ``autocast`` instances used as decorators, ``(file, line)`` of other
    entries.  ``autocast_enabled``/``autocast_dtype`` then describe it; a replay applies that
    autocast around the whole forward and switches these entries off (``diagnose.replay``)."""

    @property
    def low_precision(self) -> torch.dtype | None:
        """The low-precision dtype this forward ran in (autocast or half parameters), or None."""
        if self.autocast_enabled and self.autocast_dtype in LOW_PRECISION_DTYPES:
            return self.autocast_dtype
        return self.param_dtype if self.param_dtype in LOW_PRECISION_DTYPES else None

    @property
    def autocast(self) -> tuple[str, torch.dtype, bool]:
        """(device type, dtype, enabled): the autocast state the forward ran with."""
        return self.device.type, self.autocast_dtype, self.autocast_enabled

    def seed_grads(self) -> list[torch.Tensor | None]:
        """Per output, the gradient a replay starts backward from: the pre-cast one where kept."""
        return [g32 if g32 is not None else g for g, g32 in zip(self.grads, self.grads_fp32)]

    def outputs_finite(self) -> bool:
        """Whether every captured output is finite (a host read: failure path only)."""
        return all(bool(torch.isfinite(o.detach()).all()) for o in (*self.outputs, *self.untracked_outputs))

    def grads_finite(self) -> bool | None:
        """Whether the gradients that reached the outputs are finite (pre-cast ones where kept); None
        when no gradient was captured.  A host read: failure path only."""
        grads = [g for g in self.seed_grads() if g is not None]
        if not grads:
            return None
        return all(bool(torch.isfinite(g).all()) for g in grads)

    @contextlib.contextmanager
    def running_stats_before(self) -> Iterator[None]:
        """Temporarily put the model's running statistics back to their values before this forward."""
        if self.running_before is None:
            yield
            return
        buffers, before = self.running_before
        now = torch._foreach_mul(buffers, 1.0)
        with torch.no_grad():
            torch._foreach_copy_(buffers, before)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(buffers, now)


@dataclass
class Root:
    model: nn.Module
    """Held strongly while hooked (the script doctor's report is built after the script's namespace is gone)."""
    device: torch.device
    param_dtype: torch.dtype | None
    handles: list[Any]
    running: list[torch.Tensor]
    """Its normalisation layers' running statistics (snapshotted before each forward)."""
    label: str = ""
    """The name the script gives the model (its variable), else its class name (script doctor)."""


class CaptureHooks:
    """The forward and cast hooks that make a ``Capture`` of every root forward (see the module docstring).

    ``on_root_forward(capture)`` is called after each root forward; ``on_root_enter()`` as one starts;
    ``locate()`` names the user's calling line.  ``grad_only`` leaves forwards that autograd does not
    record uncaptured; ``max_captures`` bounds the window (the oldest goes), ``grad_capture_numel`` the
    output elements whose gradient one forward keeps (None: no bound).
    """

    captures: PerThread[list[Capture]] = PerThread(list)
    """This thread's forwards of the current window (cleared by ``new_window``)."""
    _stack: PerThread[list[nn.Module]] = PerThread(list)
    _pending: PerThread[Capture | None] = PerThread(lambda: None)
    step = PerThread(lambda: 1)
    """The step this thread's next forward belongs to, counted from 1."""
    paused = PerThread(bool)
    """True while the doctor itself runs models (replays) in this thread: its hooks then do nothing."""

    def __init__(self, *, on_root_forward: Callable[[Capture], None] = lambda cap: None,
                 locate: Callable[[], str | None] = lambda: None, on_root_enter: Callable[[], None] = lambda: None,
                 grad_only: bool = False, max_captures: int | None = 8,
                 grad_capture_numel: int | None = 1 << 24) -> None:
        self._on_root_forward = on_root_forward
        self._on_root_enter = on_root_enter
        """Called as a root forward starts (outside any torch function: the loss-side tape leaves the stack)."""
        self._locate = locate
        self.grad_only = grad_only
        self.max_captures = max_captures
        self.grad_capture_numel = grad_capture_numel
        self.roots: dict[int, Root] = {}
        self.last: Capture | None = None
        self._windows: dict[int, tuple[threading.Thread, list[Capture]]] = {}
        """Each thread's window (the ``captures`` list object) by thread ident, registered when it gets its
        first capture; kept after the thread ended (a plain thread's forward, joined before the backward)
        until the next backward took what feeds it (``window``)."""

    # -- roots -------------------------------------------------------------------------------
    def add_root(self, module: nn.Module, label: str = "") -> None:
        """Hook ``module``'s forwards (once)."""
        if id(module) in self.roots:
            return
        device, dtype = _device_and_dtype(module)
        handles = [
            module.register_forward_pre_hook(own_hook(module, self._root_pre)),
            # always_call: a forward that raises still leaves the nesting balanced
            module.register_forward_hook(own_hook(module, self._root_post), with_kwargs=True, always_call=True),
        ]
        self.roots[id(module)] = Root(module, device, dtype, handles, _running_stats(module), label)

    def refresh_roots(self) -> None:
        """Re-read each root's device and parameter dtype (after ``model.to(...)`` / ``.half()``)."""
        for root in self.roots.values():
            root.device, root.param_dtype = _device_and_dtype(root.model)
            root.running = _running_stats(root.model)

    def remove(self) -> None:
        """Remove the hooks from every root."""
        self._stack.clear()
        for root in self.roots.values():
            for h in root.handles:
                h.remove()
            root.handles = []

    @property
    def in_forward(self) -> bool:
        """Whether a watched model's forward is running (its ops are the model's, not the loss code's)."""
        return bool(self._stack)

    # -- hooks -----------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.compiler.is_compiling() or self.paused:
            return
        if self._stack:
            self._stack.append(module)
            return
        self._on_root_enter()
        self._stack.append(module)
        root = self.roots.get(id(module))
        if root is None or (self.grad_only and not torch.is_grad_enabled()):
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
                if budget is None or x.numel() <= budget:
                    budget = None if budget is None else budget - x.numel()
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
    def on_backward(self, tensors: list[torch.Tensor], loss: torch.Tensor | None,
                    scale: torch.Tensor | None) -> list[Capture]:
        """Attach the (unscaled) loss to this window's captures that have none (other threads' that feed
        ``tensors`` included, ``window``) and return them; hook each cast that is an output's sole consumer
        on the way from ``tensors``, to keep the pre-cast gradient (``ampkit._util.autograd.sole_cast_consumers``)."""
        fresh = self.window(tensors)
        if not fresh or not tensors:
            return fresh
        for c in fresh:
            c.loss = loss.detach() if loss is not None else None
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
        if self.max_captures is not None and len(window) >= self.max_captures:
            window.pop(0)
        window.append(cap)

    def new_window(self) -> list[Capture]:
        """The optimizer stepped: the captured forwards belong to the past; returns them."""
        taken = list(self.captures)
        self.captures.clear()
        return taken


class _GradSink:
    """Tensor hook that keeps a reference to the gradient an output received (no copy)."""

    __slots__ = ("cap", "i")

    def __init__(self, cap: Capture, i: int) -> None:
        self.cap, self.i = cap, i

    def __call__(self, grad: torch.Tensor) -> None:
        self.cap.grads[self.i] = grad


class _PreCastSink(_GradSink):
    """Autograd-node pre-hook: keeps the gradient arriving at a cast, before it is narrowed."""

    __slots__ = ()

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:  # type: ignore[override]
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


def running_stats(module: nn.Module) -> Iterator[tuple[nn.Module, list[torch.Tensor]]]:
    """Each normalisation layer of ``module`` that tracks running statistics, with their floating buffers."""
    for mod in module.modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats:
            bufs = [b for b in (mod.running_mean, mod.running_var) if b is not None and b.is_floating_point()]
            if bufs:
                yield mod, bufs


def _running_stats(module: nn.Module) -> list[torch.Tensor]:
    return [b for _, bufs in running_stats(module) for b in bufs]


def _device_and_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype | None]:
    """The device of ``module``'s first parameter (else buffer, else the CPU) and its floating dtype."""
    for p in module.parameters():
        return p.device, p.dtype if p.is_floating_point() else None
    for b in module.buffers():
        return b.device, None
    return torch.device("cpu"), None
