"""The GradScaler watcher: ``torch.amp.GradScaler`` (and ``torch.cuda.amp.GradScaler``, a subclass) and of
ampkit's own loss scalers: scale trajectory, skipped steps, and the order of
scale → backward → unscale_ → clip → step → update.

The methods are wrapped on the class, so every import path and subclass is covered.  The
wrappers read GradScaler's own bookkeeping (``_per_optimizer_states``, ``_scale``) after the
original ran; they never change what it does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook
from typing_extensions import override

from ampkit._util.threads import thread_values
from ampkit._util.trees import leaves
from ampkit.diagnose.script import failures
from ampkit.diagnose.script.errors import exception_finding
from ampkit.diagnose.script.order import OrderContext, explain_order
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services.scalers import ScalerInfo
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.diagnose.script.where import where_now
from ampkit.findings import Finding, loss_in_low_precision_finding
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["ScalerWatch"]


def _spelling(cls: type) -> str:
    """A GradScaler class as a script spells it (torch's own under its public path)."""
    for public in ("torch.cuda.amp", "torch.amp"):
        if cls.__module__.startswith(public + "."):
            return f"{public}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


class ScalerWatch(Watcher):
    """GradScaler (torch's and ampkit's): scaling, unscale/step/update order, clipping, skipped steps.

    What it learns goes into the ``ScalerRegistry`` (``state.scalers``), which the backward, optimizer,
    checkpoint and engine watchers read.
    """

    @override
    def install(self, patches: PatchSet) -> None:
        gs = torch.amp.grad_scaler.GradScaler
        patches.wrap(gs, "__init__", self._wrap_init)
        patches.wrap(gs, "scale", self._wrap_scale)
        patches.wrap(gs, "unscale_", self._wrap_unscale)
        patches.wrap(gs, "step", self._wrap_step)
        patches.wrap(gs, "update", self._wrap_update)
        patches.wrap(gs, "state_dict", self._wrap_flag("state_taken"))
        patches.wrap(gs, "load_state_dict", self._wrap_flag("state_loaded"))
        from ampkit.scaler import LossScaler, StaticLossScaler

        for cls in (LossScaler, StaticLossScaler):
            patches.wrap(cls, "scale", self._wrap_ampkit_scale)
        # Registered before the optimizer watcher's hook (the ``Context``'s order): a direct step is
        # reported before that step's gradients are checked, which may replay it.
        patches.handle(register_optimizer_step_pre_hook(self._pre_step))
        for mod in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in ("clip_grad_norm_", "clip_grad_value_"):
                if hasattr(mod, name):
                    patches.wrap(mod, name, self._wrap_clip)

    # -- wrappers -----------------------------------------------------------------------------
    def _wrap_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __init__(sc: Any, *args: Any, **kwargs: Any) -> None:
            self.state.frames.call(orig, sc, *args, **kwargs)
            requested = kwargs.get("enabled", args[5] if len(args) > 5 else True)
            self.state.scalers.add_scaler(sc, ScalerInfo(
                location=self.state.frames.caller(), device=str(sc._device), requested=bool(requested),
                enabled=bool(sc._enabled), init_scale=float(kwargs.get("init_scale", args[1] if len(args) > 1
                                                                       else 2.0**16)),
                built_as=_spelling(type(sc)),
            ))
        return __init__

    def _wrap_flag(self, flag: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def method(sc: Any, *args: Any, **kwargs: Any) -> Any:
                out = orig(sc, *args, **kwargs)
                setattr(self.state.scalers.info(sc), flag, True)
                return out
            return method
        return make

    def _wrap_scale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def scale(sc: Any, outputs: Any) -> Any:
            self.state.tapes.stop()  # the loss is complete: it is being scaled for its backward
            out = orig(sc, outputs)
            info = self.state.scalers.info(sc)
            enabled = bool(sc._enabled)
            scale_t = info.scale_copy(sc._scale) if enabled and sc._scale is not None else None
            self.state.scalers.register_scaled(outputs, out, scale_t, enabled, "torch")
            if enabled:
                info.used += 1
                self._check_scaled(outputs, out, scale_t)
                lows = {c.low_precision for c in self.state.models.window(
                    [t for t in leaves(out) if isinstance(t, torch.Tensor)])}
                info.saw_bf16 |= torch.bfloat16 in lows
                info.saw_fp16 |= torch.float16 in lows
            return out
        return scale

    def _wrap_ampkit_scale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def scale(sc: Any, loss: torch.Tensor) -> torch.Tensor:
            self.state.tapes.stop()
            out = orig(sc, loss)
            self.state.scalers.ampkit_scaled += 1
            enabled = bool(getattr(sc, "enabled", False))
            self.state.scalers.ampkit_enabled |= enabled
            self.state.scalers.register_scaled(loss, out, sc.scale_tensor(loss.device).clone() if enabled else None, enabled, "ampkit")
            return out
        return scale

    def _check_scaled(self, outputs: Any, out: Any, scale: torch.Tensor | None) -> None:
        """LOSS_IN_LOW_PRECISION as an error: a finite low-precision loss whose scaling overflows.

        Either the scaled value itself (when the product stays in the loss's dtype), or the gradient
        seed: backward enters the loss with d(loss × scale)/d(loss) = scale, rounded to the loss's
        dtype, so an fp16 loss overflows at every scale above 65504 whatever its value.
        """
        for a, b in zip(leaves(outputs), leaves(out)):
            if isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION_DTYPES:
                it = self.state.step
                location = self.state.frames.caller()
                overflow = (~torch.isfinite(b.detach())).any() & torch.isfinite(a.detach()).all()
                if scale is not None:
                    overflow = overflow | (scale > torch.finfo(a.dtype).max)

                def judge(v: float, a_dtype: torch.dtype = a.dtype, it: int = it,
                          location: str | None = location) -> None:
                    if v > 0:
                        self.state.scalers.scaled_overflow.add(it)
                        self.state.ledger.add(loss_in_low_precision_finding(
                            a_dtype, overflowed=True, location=location, step=it), key=location)
                self.state.pending.read(overflow, judge)

    def _explain_order(self, exc: BaseException, sc: Any, call: str) -> None:
        """UNSCALE_ORDER_ERROR for GradScaler's own step-order assertion, with the cause read from the
        scaler's state at the raise (``script.order``) and where in training it happened."""
        text = str(exc)
        if "No inf checks were recorded prior" in text and self.state.scalers.direct_steps and self.state.ledger.has(
                "UNSCALE_ORDER_ERROR"):
            self.state.explained = exc
            return  # the consequence of the optimizer.step() that bypassed the scaler, already reported
        info = self.state.scalers.info(sc)
        rule = explain_order(text, OrderContext(
            call, backwards=self.state.scalers.backwards_since_update, stepped=info.stepped_since_update,
            other_scaler_scaled=any(i.used for i in self.state.scalers.infos if i is not info),
            optimizers=len(self.state.optimizers)))
        if rule is None:
            return
        frames, it = self.state.frames, self.state.step
        location = frames.caller(2)
        finding = exception_finding(exc, "UNSCALE_ORDER_ERROR", rule.message(text), rule.fix, location=location,
                                    module=None, step=it,
                                    where=where_now(frames, self.state.models, self.state.iteration, skip=2),
                                    evidence=rule.evidence(call))
        self.state.ledger.add(finding, key=location)
        self.state.explained = exc

    def _wrap_unscale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def unscale_(sc: Any, optimizer: torch.optim.Optimizer) -> Any:
            try:
                out = orig(sc, optimizer)
            except (RuntimeError, AssertionError) as exc:
                self._explain_order(exc, sc, "unscale_")
                raise
            if sc._enabled:
                self.state.scalers.info(sc).unscaled_since_update = True
            return out
        return unscale_

    def _wrap_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def step(sc: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            mine = thread_values(self.state.scalers)  # per-step: writes with no Python frame
            mine.in_step += 1
            try:
                out = orig(sc, optimizer, *args, **kwargs)
            except (RuntimeError, AssertionError) as exc:
                self._explain_order(exc, sc, "step")
                raise
            finally:
                mine.in_step -= 1
            primary = self.state.optimizers.is_primary(optimizer)
            if sc._enabled:
                info = self.state.scalers.info(sc)
                info.stepped_since_update = True
                state = sc._per_optimizer_states.get(id(optimizer))
                per_dev = list(state["found_inf_per_device"].values()) if state else []
                if per_dev:
                    found = per_dev[0] if len(per_dev) == 1 else torch.stack([f.to(per_dev[0].device) for f in per_dev]).sum()
                    failures.found_read(self.state, optimizer, found, info.scale_copy(sc._scale), primary)
            if primary:
                failures.end_iteration(self.state)
            return out
        return step

    def _wrap_update(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def update(sc: Any, new_scale: Any = None) -> Any:
            info = self.state.scalers.info(sc)
            if sc._enabled and new_scale is None and not info.stepped_since_update and info.unscaled_since_update:
                location = self.state.frames.caller()
                self.state.ledger.add(Finding(
                    code="ACCUMULATION_SCALE_CHANGE", severity="error",
                    message=(
                        "scaler.update() ran on a micro-batch that did not step the optimizer: the loss scale "
                        "can change while gradients accumulate, so the window sums gradients multiplied by "
                        "different scales (and gradients already unscaled by unscale_() get mixed with new "
                        "scaled ones)"
                    ),
                    fix=("call scaler.unscale_/clip/scaler.step/scaler.update only at the accumulation boundary: "
                         "`if (i + 1) % accum == 0: scaler.unscale_(opt); clip...; scaler.step(opt); "
                         "scaler.update(); opt.zero_grad()`"),
                    location=location, step=self.state.step,
                ), key=location)
            try:
                out = orig(sc, new_scale)
            except (RuntimeError, AssertionError) as exc:
                self._explain_order(exc, sc, "update")
                raise
            if sc._enabled:
                it = self.state.step
                self.state.pending.read(info.scale_copy(sc._scale), lambda v: info.scales.append((it, v)))
            info.stepped_since_update = info.unscaled_since_update = info.backward_scaled = False
            self.state.scalers.after_update()
            return out
        return update

    # -- clipping and direct optimizer steps ---------------------------------------------------
    def _wrap_clip(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.on_clip(params, getattr(orig, "__name__", "clip_grad_norm_"))
            return orig(params, *args, **kwargs)
        return clip

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not torch.compiler.is_compiling() and not self.state.scalers.in_step:
            self.on_direct_step(opt)

    def on_clip(self, params: list[torch.Tensor], fname: str) -> None:
        scalers = [(sc, info) for sc, info in self.state.scalers.enabled_scalers() if info.backward_scaled]
        if not scalers:
            return
        owners = self.state.optimizers.owners(params)
        for sc, info in scalers:
            # An engine's info is scaled exactly from its backward to its unscale (watchers.engine).
            states = [] if info.engine else [sc._per_optimizer_states.get(id(o)) for o in owners] or [None]
            if info.engine or any(s is None or s["stage"] is OptState.READY for s in states):
                self._clip_before_unscale(fname, info)
                return

    def _clip_before_unscale(self, fname: str, info: ScalerInfo) -> None:
        location = self.state.frames.caller()
        if info.engine:
            unscaled_by = f"the {info.built_as} engine unscales them inside its step, after this call"
            fix = ("let the engine clip after its unscale: `MixedPrecision(..., clip_grad_norm=max_norm)` (under "
                   "Lightning with AmpkitPrecision: `Trainer(gradient_clip_val=max_norm)`, or clip in "
                   "`on_before_optimizer_step`, which runs on the unscaled gradients)")
        else:
            unscaled_by = "scaler.unscale_(optimizer) was not called first"
            fix = ("call scaler.unscale_(optimizer) right before clipping: `scaler.scale(loss).backward(); "
                   "scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); "
                   "scaler.step(optimizer); scaler.update()`")
        self.state.ledger.add(Finding(
            code="CLIP_BEFORE_UNSCALE", severity="error",
            message=(
                f"{fname} ran on gradients that still hold loss × scale ({unscaled_by}): the threshold is "
                "compared with scaled norms, so gradients are clipped far harder than intended (or not at all "
                "once the scale drops)"
            ),
            fix=fix, location=location, step=self.state.step, evidence={"function": fname},
        ), key=location)

    def on_direct_step(self, opt: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` called outside ``scaler.step`` while gradients are scaled."""
        self.state.scalers.direct_steps += 1
        for _sc, info in self.state.scalers.enabled_scalers():
            if info.backward_scaled and not info.engine:
                location = self.state.frames.caller()
                self.state.ledger.add(Finding(
                    code="UNSCALE_ORDER_ERROR", severity="error",
                    message=(
                        f"{type(opt).__name__}.step() was called directly while the gradients hold loss × scale: "
                        "the update uses gradients multiplied by the loss scale and skips GradScaler's inf/NaN "
                        "check"
                    ),
                    fix="replace optimizer.step() with scaler.step(optimizer), followed by scaler.update()",
                    location=location, step=self.state.step,
                ), key=("direct", location))
                return
