"""``Engine``: autocast, loss scaling and the documented step order in one object.

The order is fixed by construction::

    backward:  loss / grad_accumulation -> * scale -> .backward()
    step:      (no-op until the accumulation boundary)
               unscale (fused, + non-finite check) -> clip -> step or skip -> scaler.update
               -> zero_grad   (no loss scaler: the non-finite check is read off the clip's norm)

Every operation is the one ``torch.autocast`` + ``torch.amp.GradScaler`` perform in the
official recipe, in the same order, so the result is bit-identical to that recipe.  The step
makes no host sync for torch's fused optimizers (Adam, AdamW, SGD, Adagrad with ``fused=True``),
whose kernels read ``found_inf`` themselves; for other optimizers exactly one remains: reading
``found_inf`` to decide whether to call ``optimizer.step()`` (``ampkit.engine._boundary``).

The engine knows its extensions only as ``EngineHook`` objects (``ampkit.hooks``); ``ampkit.MixedPrecision``
(``ampkit.mixed_precision``) adds the ``telemetry=`` and ``doctor=`` shorthands on top of it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit import hooks as _hooks
from ampkit._util.nested import flatten_tensors
from ampkit._util.overrides import overrides
from ampkit.engine import _boundary
from ampkit.engine._guards import (
    check_backward_loss,
    check_no_closure,
    check_optimizer,
    check_param,
    no_gradients_error,
)
from ampkit.engine._state import EngineState, check_engine_state
from ampkit.engine.config import EngineConfig
from ampkit.fp8 import Fp8Converter, Fp8Filter
from ampkit.policy import Fp32Policy, KeepFp32Rule, check_keep_fp32
from ampkit.precision import Precision
from ampkit.scaler import LossScaler, resolve_scaler

__all__ = ["Engine"]


@dataclass
class _OptState:
    checked: bool = False
    param_count: int = field(default=0)
    by_norm: bool = False  # checks_by_norm(its parameters): found_inf may come from the clip's norm


class Engine:
    """Mixed-precision training engine; extensions attach as ``EngineHook`` objects.

    Args:
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp8-rowwise"``, ``"fp8-rowwise-gw-hp"``,
            ``"auto"`` or an alias.
        device: the device autocast runs on (``"auto"``: cuda, xpu, mps, then cpu).
        scaler: a ``LossScaler``, or ``"dynamic"``, ``"static"``, ``"none"``; default dynamic for
            fp16 and none for bf16/fp32.
        grad_accumulation: micro-batches per optimizer step.
        clip_grad_norm: max global L2 norm of the unscaled gradients, or None.
        keep_fp32: module name patterns or types to run in fp32 (applied by ``prepare``); None: none.
        skip_nonfinite: skip steps whose gradients hold inf/NaN even without loss scaling.
        fp8_filter: fp8 only, the Linear layers ``prepare`` converts (``ampkit.fp8``; docs/fp8.md).
        hooks: ``EngineHook`` objects, attached in order with ``add_hook``; None: none.

    The configuration lives in ``config`` (an ``EngineConfig``); ``precision``, ``grad_accumulation``,
    ``clip_grad_norm`` and ``skip_nonfinite`` read from it.  ``fp8`` converts models in ``prepare``.

    Example (the loop from the README, with a tiny model)::

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    >>> mp = Engine("bf16", device="cpu", grad_accumulation=2, clip_grad_norm=1.0)
    >>> for step in range(4):
    ...     with mp.autocast():
    ...         loss = model(torch.randn(8, 4)).float().pow(2).mean()
    ...     mp.backward(loss)
    ...     result = mp.step(opt)
    >>> result.boundary, result.applied, mp.optimizer_steps
    (True, True, 2)
    """

    def __init__(
        self,
        precision: str | Precision = "auto",
        *,
        device: str | torch.device | None = "auto",
        scaler: LossScaler | str | None = None,
        grad_accumulation: int = 1,
        clip_grad_norm: float | None = None,
        keep_fp32: Sequence[KeepFp32Rule] | None = (),
        skip_nonfinite: bool = True,
        hooks: Sequence[_hooks.EngineHook] | None = (),
        fp8_filter: Fp8Filter = None,
    ) -> None:
        self.config = EngineConfig(precision=Precision.parse(precision, device), grad_accumulation=grad_accumulation,
                                   clip_grad_norm=clip_grad_norm, keep_fp32=check_keep_fp32(keep_fp32),
                                   skip_nonfinite=skip_nonfinite, fp8_filter=fp8_filter)
        self.fp8 = Fp8Converter(self.precision, keep_fp32=self.config.keep_fp32, fp8_filter=self.config.fp8_filter)
        self.device = self.precision.device
        self.scaler = resolve_scaler(scaler, self.precision).to(self.device)
        self.policy = Fp32Policy(self.config.keep_fp32, self.device.type)
        self.micro_step = 0
        """Micro-batches seen since the last boundary (0 .. grad_accumulation-1)."""
        self.optimizer_steps = 0
        """Boundary steps taken (applied or skipped)."""
        self.models: list[nn.Module] = []
        """Models passed to ``prepare`` (the doctor's replay hooks them)."""
        self._opt_states: dict[int, _OptState] = {}
        self._warned: set[str] = set()
        self._loss_nonfinite: torch.Tensor | None = None
        """On-device count of non-finite losses since the last boundary (None: none seen yet)."""
        self._hooks: list[_hooks.EngineHook] = []
        self._reducers: list[_hooks.EngineHook] = []
        self._closed = False
        for hook in hooks or ():  # None: no hooks
            self.add_hook(hook)

    # -- configuration (read from ``config``) ------------------------------------------------------
    @property
    def precision(self) -> Precision:
        """The resolved precision (autocast dtype, loss-scaling need, device)."""
        return self.config.precision

    @property
    def grad_accumulation(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.grad_accumulation

    @property
    def clip_grad_norm(self) -> float | None:
        """Max global gradient norm, or None (no clipping)."""
        return self.config.clip_grad_norm

    @property
    def skip_nonfinite(self) -> bool:
        """Whether steps with inf/NaN gradients are skipped without loss scaling too."""
        return self.config.skip_nonfinite

    # -- hooks -------------------------------------------------------------------------------------
    @property
    def hooks(self) -> tuple[_hooks.EngineHook, ...]:
        """The attached hooks, in call order (attach with ``add_hook``)."""
        return tuple(self._hooks)

    @property
    def reduces_found_inf(self) -> bool:
        """True when an attached hook overrides ``reduce_found_inf`` (each rank checks only its shards)."""
        return bool(self._reducers)

    def add_hook(self, hook: _hooks.EngineHook, *, first: bool = False) -> None:
        """Attach ``hook`` (its ``on_attach(engine)`` runs now); ``first`` puts it before the others."""
        if not isinstance(hook, _hooks.EngineHook):
            raise TypeError(f"hooks=[..., {hook!r}]: a hook must subclass ampkit.EngineHook")
        if any(h is hook for h in self._hooks):
            raise ValueError(f"{hook!r} is already attached to this engine")
        hook.on_attach(self)
        self._hooks.insert(0 if first else len(self._hooks), hook)
        self._find_reducers()

    def remove_hook(self, hook: _hooks.EngineHook) -> None:
        """Detach ``hook`` (it is not closed: the caller owns it again)."""
        self._hooks = [h for h in self._hooks if h is not hook]
        self._find_reducers()

    def _find_reducers(self) -> None:
        # Decided on attach, not per step: the hot path only iterates this list.
        self._reducers = [h for h in self._hooks if overrides(h, _hooks.EngineHook, "reduce_found_inf")]

    def emit(self, event: _hooks.HookEvent) -> bool:
        """Deliver ``event`` to every hook's ``on_event``; True when one of them acted on it."""
        handled = False
        for hook in list(self._hooks):
            handled = bool(hook.on_event(self, event)) or handled
        return handled

    def close(self) -> None:
        """Close every hook (flush telemetry, remove module hooks).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.close()

    # -- public API ------------------------------------------------------------------------------
    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale as a float32 tensor on the engine's device (1.0 without scaling)."""
        return self.scaler.scale_tensor(self.device)

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``step`` is an accumulation boundary (DDP must all-reduce then)."""
        return (self.micro_step + 1) % self.grad_accumulation == 0

    def autocast(self) -> torch.autocast:
        """The autocast context for the forward pass and the loss."""
        return torch.autocast(
            device_type=self.device.type, dtype=self.precision.dtype, enabled=self.precision.autocast_enabled
        )

    def prepare(self, model: nn.Module) -> nn.Module:
        """Check ``model``, convert it for fp8, apply keep-fp32; returns the model to train (fp8: maybe a new one)."""
        for name, p in model.named_parameters():
            check_param(p, where=f"parameter {name!r}", device=self.device, scaled=self.scaler.enabled)
        self.policy.check_unshared(model)
        model = self.fp8.convert(model)
        self.policy.apply(model)
        if all(m is not model for m in self.models):
            self.models.append(model)
            for hook in self._hooks:
                hook.on_prepare(self, model)
        return model

    def release(self, model: nn.Module) -> list[str]:
        """Remove the keep-fp32 hooks this engine's ``prepare`` put on ``model``; returns the module names.

        Before another engine prepares the same model (it refuses modules this one keeps and it does
        not).  ``close`` leaves them: a model is often evaluated after training.
        """
        return self.policy.release(model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """``model.no_sync()`` inside an accumulation window for DDP models, else a null context."""
        if not self.sync_gradients and hasattr(model, "no_sync"):
            return model.no_sync()  # type: ignore[operator,no-any-return]
        return contextlib.nullcontext()

    def backward(self, loss: Any, **backward_kwargs: Any) -> None:
        """Divide by ``grad_accumulation``, scale (fp16), and run backward.

        Call it once per loss; several losses per step are fine.  ``loss`` may also be nested
        lists/tuples of tensors (as ``GradScaler.scale`` takes): each is divided and scaled, and
        one ``torch.autograd.backward`` runs on them all.  Keyword arguments go to
        ``Tensor.backward`` for a tensor (``retain_graph``, ``inputs``) and to
        ``torch.autograd.backward`` for a structure (``grad_tensors`` in depth-first order).
        """
        if self.precision.autocast_enabled and torch.is_autocast_enabled(self.device.type):
            self._warn_once(
                "backward_in_autocast",
                "mp.backward() was called inside mp.autocast(): backward ops run in the dtype their "
                "forward ops chose, so autocast gains nothing here and may cast more; move the "
                "backward call out of the `with mp.autocast():` block",
            )
        seeded = backward_kwargs.get("gradient" if isinstance(loss, torch.Tensor) else "grad_tensors") is not None
        scaled, _ = self._scale_leaves(loss, "mp.backward(loss)", seeded=seeded)
        if isinstance(loss, torch.Tensor):
            scaled[0].backward(**backward_kwargs)
        else:
            torch.autograd.backward(scaled, **backward_kwargs)

    def scale_loss(self, loss: Any) -> Any:
        """Everything ``backward`` does before ``.backward()``; returns the tensor(s) to run it on.

        For a framework that runs backward itself (a Lightning precision plugin): the hooks see
        ``loss``, the non-finite flag is recorded, and the result is divided and scaled.  Like
        ``GradScaler.scale``, ``loss`` may be a tensor or nested lists/tuples (any iterable) of
        tensors, and the result has the same structure (an iterable that is not a list or tuple
        comes back as an iterator).  No warning for a call inside autocast: the framework, not
        the user, places that call.
        """
        return self._scale_leaves(loss, "mp.scale_loss(loss)")[1]

    def _scale_leaves(self, loss: Any, call: str, *, seeded: bool | None = None) -> tuple[list[torch.Tensor], Any]:
        leaves, rebuild = flatten_tensors(loss, call=call)
        if seeded is not None:  # mp.backward: a loss backward would refuse is refused before any hook sees it
            check_backward_loss(leaves, seeded=seeded)
        for leaf in leaves:
            # One call per tensor, as if each had its own mp.backward: hooks see tensors only.
            for hook in self._hooks:
                hook.on_backward(self, leaf)
        scaled = [self._divide_and_scale(leaf) for leaf in leaves]
        return scaled, rebuild(scaled)

    def _divide_and_scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.grad_accumulation > 1:
            loss = loss / self.grad_accumulation
        if self.scaler.enabled or self.skip_nonfinite:
            # A NaN loss can have finite gradients (log of a negative value): remember it so the
            # step is skipped too.  A few scalar kernels, no host sync.
            bad = (~torch.isfinite(loss.detach())).any().to(device=self.device, dtype=torch.float32)
            self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite + bad
        return self.scaler.scale(loss)

    def step(
        self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], closure: object = None,
    ) -> _hooks.StepResult:
        """Count one micro-batch; at the boundary unscale, clip, step or skip, update, zero_grad.

        A ``closure``, or an optimizer whose step needs one (LBFGS), is refused before anything moves.
        """
        opts = _boundary.as_optimizers(optimizers)
        check_no_closure(opts, closure)
        self.micro_step += 1
        if self.micro_step < self.grad_accumulation:
            return _hooks.StepResult(boundary=False, optimizer_step=self.optimizer_steps)
        self.micro_step = 0
        for opt in opts:
            self._check_optimizer(opt)
        scale = self.scale
        per_opt_found, grad_norm = self._unscale_and_clip(opts)
        if grad_norm is None:  # no parameter had a gradient; after the unscale hooks, whose refusals say more
            raise no_gradients_error(opts)
        found_inf = per_opt_found[0] if len(per_opt_found) == 1 else torch.stack(per_opt_found).sum()
        for hook in self._hooks:
            hook.before_optimizer_step(self, opts, found_inf, grad_norm)
        checked = self.scaler.enabled or self.skip_nonfinite
        for opt, found in zip(opts, per_opt_found):
            _boundary.step_or_skip(opt, found, checked=checked)
        # The update reads found_inf after the steps, matching GradScaler.update's order.
        scale_used = scale.clone() if self.scaler.enabled else scale
        self.scaler.update(found_inf)
        self.optimizer_steps += 1
        result = _hooks.StepResult(
            boundary=True, found_inf=found_inf, grad_norm=grad_norm, scale=scale_used,
            optimizer_step=self.optimizer_steps,
        )
        for hook in self._hooks:
            hook.after_step(self, result, opts)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        return result

    def scheduler_step(self, scheduler: Any, result: _hooks.StepResult) -> bool:
        """Advance ``scheduler`` only when ``result`` applied an update; returns whether it did.

        Reading ``result.applied`` is one host sync per boundary.  Because the scheduler never
        advances on a step whose ``optimizer.step()`` did not run, torch's "lr_scheduler.step()
        before optimizer.step()" warning cannot fire.
        """
        if not result.boundary or not result.applied:
            return False
        scheduler.step()
        return True

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Scaler state (GradScaler layout), accumulation position and step count."""
        described = self.config.describe()
        return {
            "precision": described["precision"],
            "grad_accumulation": described["grad_accumulation"],
            "micro_step": self.micro_step,
            "optimizer_steps": self.optimizer_steps,
            "scaler": self.scaler.state_dict(),
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> EngineState:
        """Raise unless ``state_dict`` fits this engine (keys, types, ranges, precision); changes nothing."""
        state = check_engine_state(state_dict, precision=self.precision.name, grad_accumulation=self.grad_accumulation)
        if state.scaler or not self.scaler.enabled:  # saved without loss scaling: the scaler starts fresh
            self.scaler.check_state_dict(state.scaler)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``, or the scaler from a ``torch.amp.GradScaler.state_dict()``.

        Everything is checked before anything changes.  A GradScaler state sets only the scaler:
        the accumulation position and ``optimizer_steps`` stay as they are.
        """
        state = self.check_state_dict(state_dict)
        if state.micro_step is not None and state.optimizer_steps is not None:
            self.micro_step, self.optimizer_steps = state.micro_step, state.optimizer_steps
        if state.scaler:
            self.scaler.load_state_dict(state.scaler)
            self.scaler.to(self.device)

    # -- internals ---------------------------------------------------------------------------------
    def _unscale_and_clip(
        self, opts: list[torch.optim.Optimizer],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Unscale and check each optimizer's gradients, make found_inf global, clip (hook order)."""
        by_norm = self._checks_by_norm(opts)
        per_opt_found = [] if by_norm else self._merge_loss_flag([self._unscale(opt) for opt in opts])
        for hook in self._hooks:
            hook.after_unscale(self, opts)
        for reducer in self._reducers:  # hooks that keep EngineHook's identity need no call
            per_opt_found = [reducer.reduce_found_inf(self, f) for f in per_opt_found]
        grad_norm = self._clip_and_norm(opts)
        if by_norm:
            per_opt_found = self._merge_loss_flag([_boundary.found_inf_from_norm(grad_norm, self.device)])
        for hook in self._hooks:
            # An asynchronous reduction overlapped the clip above; found_inf is read next.
            hook.wait_found_inf(self)
        return per_opt_found, grad_norm

    def _checks_by_norm(self, opts: list[torch.optim.Optimizer]) -> bool:
        # Without a loss scaler, unscaling multiplies by 1 only to check: a read and write of every gradient
        # (40 us of bench_fp8.py's 24 ms step).  The clip's norm reads them anyway and is non-finite when one
        # is, so found_inf comes from it (one pass, not two; the gradients as the optimizer reads them, after
        # the after_unscale hooks).  Not for several optimizers (a verdict each) or a reducer (local shards).
        return (not self.scaler.enabled and self.skip_nonfinite and not self._reducers and len(opts) == 1
                and self._opt_states[id(opts[0])].by_norm)

    def _merge_loss_flag(self, per_opt_found: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._loss_nonfinite is not None:
            for found in per_opt_found:
                # max, never a sum: fused optimizers skip only when found_inf == 1.0 exactly.
                torch.maximum(found, self._loss_nonfinite.clamp(max=1.0), out=found)
            self._loss_nonfinite = None
        return per_opt_found

    def _unscale(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.scaler.enabled or self.skip_nonfinite:
            self.scaler.unscale_(_boundary.grads_to_unscale(opt, local=bool(self._reducers)), found_inf)
        return found_inf

    def _clip_and_norm(self, opts: Sequence[torch.optim.Optimizer]) -> torch.Tensor | None:
        params = [p for opt in opts for g in opt.param_groups for p in g["params"] if p.grad is not None]
        return _boundary.clip_or_norm(params, self.clip_grad_norm, self.models, opts) if params else None

    def _check_optimizer(self, opt: torch.optim.Optimizer) -> None:
        state = self._opt_states.setdefault(id(opt), _OptState())
        count = sum(len(g["params"]) for g in opt.param_groups)
        if state.checked and state.param_count == count:
            return
        check_optimizer(opt, device=self.device, scaled=self.scaler.enabled)
        state.by_norm = _boundary.checks_by_norm(p for g in opt.param_groups for p in g["params"])
        state.checked, state.param_count = True, count

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def __repr__(self) -> str:
        described = self.config.describe()
        fields = ", ".join(f"{k}={v!r}" for k, v in described.items() if k not in ("precision", "device_type"))
        return (f"{type(self).__name__}({described['precision']!r}, device={str(self.device)!r}, "
                f"scaler={type(self.scaler).__name__}, {fields})")

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - guard against `for x in mp`
        raise TypeError("MixedPrecision is not iterable; use mp.autocast(), mp.backward(loss), mp.step(opt)")

