"""Observers of autocast, backward, optimizers, LR schedulers and gradient clipping.

Each wrapper does a little Python bookkeeping and calls the original; none reads a device
value except through ``Context.pending`` (free on CPU, batched on accelerators).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.optim.lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ampkit.diagnose.script.patches import PatchSet

if TYPE_CHECKING:
    from ampkit.diagnose.script.context import Context
    from ampkit.diagnose.script.watchers.model import Capture

__all__ = ["AutocastWatch", "BackwardWatch", "OptimWatch"]

_LOW = (torch.float16, torch.bfloat16)
_DT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype | None) -> str:
    return _DT.get(dtype, str(dtype).replace("torch.", "")) if dtype is not None else "none"


@dataclass
class AutocastRequest:
    device_type: str
    dtype: torch.dtype
    requested: bool
    effective: bool
    location: str | None
    entered: int = 0


class AutocastWatch:
    """Autocast regions (outermost ``with`` blocks, the scope of autocast's weight-cast cache)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.depth = 0
        self.region = 0
        self.region_location: str | None = None
        self.region_stepped: str | None = None
        """Where an optimizer stepped inside the current region (its cached casts are stale)."""
        self.requests: dict[tuple[str | None, str, torch.dtype], AutocastRequest] = {}

    def install(self, patches: PatchSet) -> None:
        cls = torch.amp.autocast_mode.autocast
        patches.wrap(cls, "__init__", self._wrap_init)
        patches.wrap(cls, "__enter__", self._wrap_enter)
        patches.wrap(cls, "__exit__", self._wrap_exit)

    def _wrap_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        code = self.ctx.code

        def __init__(ac: Any, *args: Any, **kwargs: Any) -> None:
            device = kwargs.get("device_type", args[0] if args else None)
            if device == "cuda" and not torch.cuda.is_available():
                code.call(orig, ac, *args, **kwargs)  # torch warns: keep the warning on the user's line
            else:
                orig(ac, *args, **kwargs)
            if self.ctx.paused:
                return
            requested = kwargs.get("enabled", args[2] if len(args) > 2 else True)
            ac._ampkit_requested = bool(requested)
            ac._ampkit_location = code.caller()
        return __init__

    def _wrap_enter(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def __enter__(ac: Any) -> Any:
            out = orig(ac)
            if self.ctx.paused:
                ac._ampkit_paused = True
                return out
            self.depth += 1
            if self.depth == 1:
                self.region += 1
                self.region_stepped = None
                self.region_location = getattr(ac, "_ampkit_location", None)
            loc = getattr(ac, "_ampkit_location", None)
            key = (loc, str(ac.device), ac.fast_dtype)
            req = self.requests.get(key)
            if req is None:
                req = self.requests[key] = AutocastRequest(
                    device_type=str(ac.device), dtype=ac.fast_dtype,
                    requested=getattr(ac, "_ampkit_requested", bool(ac._enabled)), effective=bool(ac._enabled),
                    location=loc,
                )
            req.entered += 1
            return out
        return __enter__

    def _wrap_exit(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def __exit__(ac: Any, *exc: Any) -> Any:
            try:
                return orig(ac, *exc)
            finally:
                if not getattr(ac, "_ampkit_paused", False):
                    self.depth = max(0, self.depth - 1)
        return __exit__

    def any_enabled(self) -> bool:
        return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d))

    def on_root_forward(self, cap: Capture) -> None:
        """STALE_WEIGHT_CACHE: a forward inside the region in which an optimizer already stepped."""
        if self.region_stepped is None or not cap.autocast_enabled or not torch.is_autocast_cache_enabled():
            return
        self.ctx.ledger.add(
            "STALE_WEIGHT_CACHE", key=self.region_location,
            message=(
                f"the optimizer stepped at {self.region_stepped} inside the autocast region opened at "
                f"{self.region_location}, and the model ran forward again in the same region: autocast "
                f"caches the {dtype_name(cap.autocast_dtype)} copy of each weight for the whole region, so "
                "this forward used the weights from before the update"
            ),
            fix=(
                "open the autocast region per step, around the forward and the loss only: "
                "`with torch.autocast(...): loss = ...` then backward, optimizer step and zero_grad outside it"
            ),
            location=self.ctx.code.caller(), step=self.ctx.iteration,
            evidence={"region_opened_at": self.region_location, "optimizer_step_at": self.region_stepped},
        )


@dataclass
class OptInfo:
    location: str | None
    checked: int = -1
    last_found: tuple[torch.Tensor, int] | None = None
    """(found_inf, iteration) of the last scaler.step on this optimizer (None: stepped directly)."""
    steps: int = 0


class OptimWatch:
    """Optimizer construction and steps, LR schedulers, gradient clipping."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptInfo] = weakref.WeakKeyDictionary()
        self.primary: weakref.ReferenceType[torch.optim.Optimizer] | None = None
        self.scheduler_steps = 0
        self._sched_depth = 0
        self.sched_on_skip: list[int] = []
        self._param_ids: dict[int, tuple[int, set[int]]] = {}

    def install(self, patches: PatchSet) -> None:
        patches.wrap(torch.optim.Optimizer, "__init__", self._wrap_opt_init)
        patches.handle(register_optimizer_step_pre_hook(self._pre_step))
        patches.handle(register_optimizer_step_post_hook(self._post_step))
        sched = torch.optim.lr_scheduler
        for obj in vars(sched).values():
            if isinstance(obj, type) and issubclass(obj, sched.LRScheduler) and "step" in vars(obj):
                patches.wrap(obj, "step", self._wrap_sched_step)
        for mod in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in ("clip_grad_norm_", "clip_grad_value_"):
                if hasattr(mod, name):
                    patches.wrap(mod, name, self._wrap_clip)

    # -- optimizers ----------------------------------------------------------------------------
    def _wrap_opt_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __init__(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            self.ctx.code.call(orig, opt, *args, **kwargs)
            if opt not in self.optimizers:
                self.optimizers[opt] = OptInfo(location=self.ctx.code.caller())
        return __init__

    def info(self, opt: torch.optim.Optimizer) -> OptInfo:
        info = self.optimizers.get(opt)
        if info is None:
            info = self.optimizers[opt] = OptInfo(location=None)
        return info

    def is_primary(self, opt: torch.optim.Optimizer) -> bool:
        if self.primary is None or self.primary() is None:
            self.primary = weakref.ref(opt)
        return self.primary() is opt

    def owners(self, params: list[torch.Tensor]) -> list[torch.optim.Optimizer]:
        """The optimizers holding any of ``params`` (parameter-id sets cached per optimizer)."""
        ids = {id(p) for p in params}
        out = []
        for opt in list(self.optimizers):
            count = sum(len(g["params"]) for g in opt.param_groups)
            cached = self._param_ids.get(id(opt))
            if cached is None or cached[0] != count:
                cached = self._param_ids[id(opt)] = (count, {id(p) for g in opt.param_groups for p in g["params"]})
            if not ids.isdisjoint(cached[1]):
                out.append(opt)
        return out

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return  # a compiled optimizer step traces the hooks: observe nothing there
        ctx = self.ctx
        info = self.info(opt)
        if not ctx.scalers.in_step:
            info.last_found = None
            ctx.scalers.on_direct_step(opt)
            if self.is_primary(opt):
                self._check_grads(opt)
        if ctx.autocast.depth and ctx.autocast.any_enabled() and ctx.autocast.region_stepped is None:
            ctx.autocast.region_stepped = ctx.code.caller()
        if info.checked < 0 or (ctx.sampler.dense(ctx.iteration) and info.checked != ctx.iteration):
            info.checked = ctx.iteration
            self._check_params(opt, info)

    def _check_grads(self, opt: torch.optim.Optimizer) -> None:
        """Non-finite gradients reaching an optimizer that no GradScaler guards (bf16, fp32, no scaler).

        One fused norm over the gradients; read at once on CPU or on dense iterations, else
        deferred (then no replay: the weights will have changed).
        """
        ctx = self.ctx
        if ctx.loss_nonfinite and ctx.iteration in ctx.loss_nonfinite:
            return  # already handled as a non-finite loss
        if not any(c.low_precision is not None for c in ctx.models.captures):
            return  # an fp32 step: its gradients are no mixed-precision matter
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads)
        bad = (~torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms]))).any()
        it = ctx.iteration
        ctx.pending.read(bad, lambda v: ctx.on_grads(it, v > 0), now=ctx.sampler.dense(it))

    def _post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        info = self.info(opt)
        info.steps += 1
        if not self.ctx.scalers.in_step and self.is_primary(opt):
            self.ctx.end_iteration()

    def _check_params(self, opt: torch.optim.Optimizer, info: OptInfo) -> None:
        low = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and p.dtype in _LOW]
        if not low:
            return
        names = self.ctx.models.param_names()
        shown = [names.get(id(p), f"<{tuple(p.shape)}>") for p in low[:5]]
        dtypes = sorted({dtype_name(p.dtype) for p in low})
        total = sum(len(g["params"]) for g in opt.param_groups)
        self.ctx.ledger.add(
            "LOW_PRECISION_PARAMS", key=id(opt),
            message=(
                f"{type(opt).__name__} (created at {info.location}) updates {len(low)} of {total} trainable "
                f"parameters stored in {'/'.join(dtypes)} ({', '.join(shown)}{', ...' if len(low) > 5 else ''}): "
                "updates smaller than the weight's rounding step (2^-11 relative in fp16, 2^-8 in bf16) are "
                "lost, so training stalls or drifts, and fp16 gradients overflow when unscaled"
            ),
            fix=(
                "keep the parameters in fp32 (remove model.half() / .to(torch.float16/bfloat16)) and run the "
                "forward under torch.autocast, which casts weights to the low precision per op"
            ),
            location=info.location, step=self.ctx.iteration,
            evidence={"low_precision_params": len(low), "params": total, "dtypes": dtypes, "examples": shown},
        )

    # -- schedulers -------------------------------------------------------------------------------
    def _wrap_sched_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            self._sched_depth += 1
            try:
                if getattr(sched, "_step_count", 0) <= 1:  # torch's order warnings fire on the first step only
                    return self.ctx.code.call(orig, sched, *args, **kwargs)
                return orig(sched, *args, **kwargs)
            finally:
                self._sched_depth -= 1
                if self._sched_depth == 0 and getattr(sched, "_step_count", 1) > 1:
                    self._on_sched_step(sched)
        return step

    def _on_sched_step(self, sched: Any) -> None:
        self.scheduler_steps += 1
        opt = getattr(sched, "optimizer", None)
        info = self.optimizers.get(opt) if opt is not None else None
        if info is None or info.last_found is None:
            return
        found, it = info.last_found
        info.last_found = None  # one scheduler step per optimizer step is judged
        # On CPU the value is read at once, so the stack walk can wait until a skip is seen.
        early = None if found.device.type == "cpu" else self.ctx.code.caller()

        def judge(v: float) -> None:
            if v > 0:
                self.sched_on_skip.append(it)
                self.ctx.note_location("scheduler_step", early or self.ctx.code.caller())
        self.ctx.pending.read(found, judge)

    # -- clipping ---------------------------------------------------------------------------------
    def _wrap_clip(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.ctx.scalers.on_clip(params, getattr(orig, "__name__", "clip_grad_norm_"))
            return orig(params, *args, **kwargs)
        return clip


class BackwardWatch:
    """``torch.autograd.backward`` (which ``Tensor.backward`` calls): loss dtype, scaling, finiteness."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.calls = 0
        self.since_update = 0
        self.fp16_unscaled: list[int] = []
        self._pending_loss: torch.Tensor | None = None
        self._scaled_now = False

    def install(self, patches: PatchSet) -> None:
        patches.wrap(torch.autograd, "backward", self._wrap_backward)

    def _wrap_backward(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self.ctx.paused:
                return orig(tensors, *args, **kwargs)
            flat = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in tensors if t is not None]
            if not flat:
                return orig(tensors, *args, **kwargs)
            self.before(flat)
            out = orig(tensors, *args, **kwargs)
            self.after(flat)
            return out
        return backward

    def before(self, flat: list[torch.Tensor]) -> None:
        ctx = self.ctx
        self.calls += 1
        self.since_update += 1
        scaled = ctx.scalers.scaled_source(flat[0])
        window = [c for c in ctx.models.captures if c.loss is None]
        low = {c.low_precision for c in window} - {None}
        loss = scaled.loss if scaled is not None else flat[0]
        self._scaled_now = scaled is not None and scaled.enabled and scaled.kind == "torch"
        ctx.models.on_backward(flat, loss, scaled.scale if scaled is not None and scaled.enabled else None)
        if torch.float16 in low and (scaled is None or not scaled.enabled):
            self.fp16_unscaled.append(ctx.iteration)
            ctx.ledger.add(
                "NO_LOSS_SCALING", key="backward",
                message=(
                    "backward ran on a loss whose forward computed in fp16 without loss scaling: gradients "
                    "smaller than 2^-24 (6e-8) flush to zero in fp16, so small updates vanish silently"
                ),
                fix=(
                    "scale the loss: `scaler = torch.amp.GradScaler(device)`, `scaler.scale(loss).backward()`, "
                    "`scaler.step(optimizer)`, `scaler.update()` (or use ampkit.MixedPrecision('fp16')), "
                    "or train in bf16, which needs no scaling"
                ),
                location=ctx.code.caller(), step=ctx.iteration,
            )
        if loss.numel() == 1 and loss.dtype in _LOW:
            location = ctx.code.caller()
            ctx.ledger.add(
                "LOSS_IN_LOW_PRECISION", key=location,
                message=(
                    f"the loss is a {dtype_name(loss.dtype)} scalar: it carries "
                    f"{'11' if loss.dtype == torch.float16 else '8'} significant bits, its reduction rounded "
                    "every partial sum, and under loss scaling loss × scale can overflow"
                ),
                fix="compute the loss in fp32: call .float() on the model output before the loss, e.g. "
                    "`loss = F.mse_loss(pred.float(), target)`",
                location=location, step=ctx.iteration,
                evidence={"loss_dtype": dtype_name(loss.dtype)},
            )
        self._pending_loss = loss

    def after(self, flat: list[torch.Tensor]) -> None:
        ctx = self.ctx
        loss = self._pending_loss if self._pending_loss is not None else flat[0]
        self._pending_loss = None
        if self._scaled_now:
            return  # a GradScaler guards this step: a skip triggers the diagnosis (and reads the loss then)
        it = ctx.iteration
        bad = (~torch.isfinite(loss.detach())).any()
        ctx.pending.read(bad, lambda v: ctx.on_loss(it, v > 0))

