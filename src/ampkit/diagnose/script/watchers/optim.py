"""The optimizer watcher: optimizer construction and steps, LR schedulers (LOW_PRECISION_PARAMS,
non-finite gradients at an unguarded step, a scheduler stepped on a skipped step).
None reads a device value except through ``RunState.pending``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.optim.lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from typing_extensions import override

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.script import failures
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services.optimizers import OptInfo
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import LOW_PRECISION_UPDATES_LOST, Finding
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["OptimWatch"]


class OptimWatch(Watcher):
    """Optimizer construction and steps, LR schedulers (gradient clipping is the scaler watcher's)."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self.scheduler_steps = 0
        self._sched_depth = 0
        self.sched_on_skip: list[int] = []

    @override
    def install(self, patches: PatchSet) -> None:
        patches.wrap(torch.optim.Optimizer, "__init__", self._wrap_opt_init)
        patches.handle(register_optimizer_step_pre_hook(self._pre_step))
        patches.handle(register_optimizer_step_post_hook(self._post_step))
        sched = torch.optim.lr_scheduler
        for obj in vars(sched).values():
            if isinstance(obj, type) and issubclass(obj, sched.LRScheduler) and "step" in vars(obj):
                patches.wrap(obj, "step", self._wrap_sched_step)

    # -- optimizers ----------------------------------------------------------------------------
    def _wrap_opt_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __init__(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            self.state.frames.call(orig, opt, *args, **kwargs)
            if opt not in self.state.optimizers.optimizers:
                self.state.optimizers.add(opt, self.state.frames.caller())
        return __init__

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return  # a compiled optimizer step traces the hooks: observe nothing there
        state = self.state
        info = state.optimizers.info(opt)
        if not state.scalers.in_step:
            info.last_found = None  # a direct step (the scaler watcher reports it, from its own hook before this one)
            if state.optimizers.is_primary(opt):
                self._check_grads(opt)
        regions = state.regions
        if regions.depth and regions.any_enabled() and regions.region_stepped is None:
            regions.region_stepped = state.frames.caller()
        if info.checked < 0 or (state.sampler.dense(state.iteration) and info.checked != state.iteration):
            info.checked = state.iteration
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
        self.state.pending.read(bad, lambda v: failures.grads_read(self.state, it, v > 0), now=self.state.sampler.dense(it))

    def _post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        state = self.state
        if not state.scalers.in_step and state.optimizers.is_primary(opt):
            failures.end_iteration(state)

    def _check_params(self, opt: torch.optim.Optimizer, info: OptInfo) -> None:
        low = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and p.dtype in LOW_PRECISION_DTYPES]
        if not low:
            return
        names = self.state.models.param_names()
        shown = [names.get(id(p), f"<{tuple(p.shape)}>") for p in low[:5]]
        dtypes = sorted({dtype_name(p.dtype) for p in low})
        total = sum(len(g["params"]) for g in opt.param_groups)
        site = self.state.casts.origin(low)
        cause = f"; {site.clause()}" if site is not None else ""
        self.state.ledger.add(Finding(
            code="LOW_PRECISION_PARAMS", severity="error",
            message=(
                f"{type(opt).__name__} (created at {info.location}) updates {len(low)} of {total} trainable "
                f"parameters stored in {'/'.join(dtypes)} ({', '.join(shown)}{', ...' if len(low) > 5 else ''}){cause}: "
                f"{LOW_PRECISION_UPDATES_LOST}, and fp16 gradients overflow when unscaled"
            ),
            fix=(
                site.fix(self.state.frameworks.autocast_setting()) if site is not None else
                "keep the parameters in fp32 (remove model.half() / .to(torch.float16/bfloat16), or load with "
                "from_pretrained(..., dtype=torch.float32)) and run the forward under torch.autocast, which casts "
                "weights to the low precision per op"
            ),
            location=site.location if site is not None and site.location else info.location,
            step=self.state.step,
            evidence={"low_precision_params": len(low), "params": total, "dtypes": dtypes, "examples": shown,
                      **({"made_low_precision": site.evidence()} if site is not None else {})},
        ), key=id(opt))

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
        info = self.state.optimizers.get(opt) if opt is not None else None
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

