"""The optimizer watcher: optimizer construction and steps, LR schedulers, gradient clipping
(LOW_PRECISION_PARAMS, non-finite gradients at an unguarded step, a scheduler stepped on a
skipped step).  None reads a device value except through ``WatchState.pending``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.optim.lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ampkit._util.dtypes import dtype_name
from ampkit._util.threads import PerThread
from ampkit.diagnose.script.patches import PatchSet
from ampkit.findings import LOW_PRECISION_UPDATES_LOST
from ampkit.precision import LOW_PRECISION_DTYPES

if TYPE_CHECKING:
    from ampkit.diagnose.script.state import WatchState
    from ampkit.diagnose.script.watchers.autocast import AutocastWatch
    from ampkit.diagnose.script.watchers.casts import CastWatch
    from ampkit.diagnose.script.watchers.scaler import ScalerWatch

__all__ = ["OptInfo", "OptimWatch"]


@dataclass
class OptInfo:
    location: str | None
    checked: int = -1
    last_found: tuple[torch.Tensor, int] | None = None
    """(found_inf, step) of the last scaler.step on this optimizer (None: stepped directly)."""
    steps: int = 0


class OptimWatch:
    """Optimizer construction and steps, LR schedulers, gradient clipping."""

    primary: PerThread[weakref.ReferenceType[torch.optim.Optimizer] | None] = PerThread(lambda: None)
    """This thread's primary optimizer, the first that stepped: its steps are the thread's steps."""

    def __init__(self, state: WatchState, *, autocast: AutocastWatch, casts: CastWatch) -> None:
        self.state = state
        self.autocast = autocast
        self.casts = casts
        self.scalers: ScalerWatch
        """Set by the context once built (the scaler watcher consults this one too)."""
        self.optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptInfo] = weakref.WeakKeyDictionary()
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
            self.state.frames.call(orig, opt, *args, **kwargs)
            if opt not in self.optimizers:
                self.optimizers[opt] = OptInfo(location=self.state.frames.caller())
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
        info = self.info(opt)
        if not self.scalers.in_step:
            info.last_found = None
            self.scalers.on_direct_step(opt)
            if self.is_primary(opt):
                self._check_grads(opt)
        if self.autocast.depth and self.autocast.any_enabled() and self.autocast.region_stepped is None:
            self.autocast.region_stepped = self.state.frames.caller()
        if info.checked < 0 or (self.state.sampler.dense(self.state.iteration) and info.checked != self.state.iteration):
            info.checked = self.state.iteration
            self._check_params(opt, info)

    def _check_grads(self, opt: torch.optim.Optimizer) -> None:
        """Non-finite gradients reaching an optimizer that no GradScaler guards (bf16, fp32, no scaler).

        One fused norm over the gradients; read at once on CPU or on dense iterations, else
        deferred (then no replay: the weights will have changed).
        """
        if self.state.loss_nonfinite and self.state.step in self.state.loss_nonfinite:
            return  # already handled as a non-finite loss
        if not any(c.low_precision is not None for c in self.state.models.captures):
            return  # an fp32 step: its gradients are no mixed-precision matter
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads)
        bad = (~torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms]))).any()
        it = self.state.step
        self.state.pending.read(bad, lambda v: self.state.signals.on_grads(it, v > 0), now=self.state.sampler.dense(it))

    def _post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        info = self.info(opt)
        info.steps += 1
        if not self.scalers.in_step and self.is_primary(opt):
            self.state.signals.end_iteration()

    def _check_params(self, opt: torch.optim.Optimizer, info: OptInfo) -> None:
        low = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and p.dtype in LOW_PRECISION_DTYPES]
        if not low:
            return
        names = self.state.models.param_names()
        shown = [names.get(id(p), f"<{tuple(p.shape)}>") for p in low[:5]]
        dtypes = sorted({dtype_name(p.dtype) for p in low})
        total = sum(len(g["params"]) for g in opt.param_groups)
        site = self.casts.origin(low)
        cause = f"; {site.clause()}" if site is not None else ""
        self.state.ledger.add(
            "LOW_PRECISION_PARAMS", key=id(opt),
            message=(
                f"{type(opt).__name__} (created at {info.location}) updates {len(low)} of {total} trainable "
                f"parameters stored in {'/'.join(dtypes)} ({', '.join(shown)}{', ...' if len(low) > 5 else ''}){cause}: "
                f"{LOW_PRECISION_UPDATES_LOST}, and fp16 gradients overflow when unscaled"
            ),
            fix=(
                site.fix() if site is not None else
                "keep the parameters in fp32 (remove model.half() / .to(torch.float16/bfloat16), or load with "
                "from_pretrained(..., dtype=torch.float32)) and run the forward under torch.autocast, which casts "
                "weights to the low precision per op"
            ),
            location=site.location if site is not None and site.location else info.location,
            step=self.state.step,
            evidence={"low_precision_params": len(low), "params": total, "dtypes": dtypes, "examples": shown,
                      **({"made_low_precision": site.evidence()} if site is not None else {})},
        )

    # -- schedulers -------------------------------------------------------------------------------
    def _wrap_sched_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            self._sched_depth += 1
            try:
                if getattr(sched, "_step_count", 0) <= 1:  # torch's order warnings fire on the first step only
                    return self.state.frames.call(orig, sched, *args, **kwargs)
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
        early = None if found.device.type == "cpu" else self.state.frames.caller()

        def judge(v: float) -> None:
            if v > 0:
                self.sched_on_skip.append(it)
                self.state.note_location("scheduler_step", early or self.state.frames.caller())
        self.state.pending.read(found, judge)

    # -- clipping ---------------------------------------------------------------------------------
    def _wrap_clip(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.scalers.on_clip(params, getattr(orig, "__name__", "clip_grad_norm_"))
            return orig(params, *args, **kwargs)
        return clip

