"""``MixedPrecision``: autocast, loss scaling and the documented step order in one object.

The order is fixed by construction::

    backward:  loss / grad_accumulation -> * scale -> .backward()
    step:      (no-op until the accumulation boundary)
               unscale (fused, + non-finite check) -> clip -> step or skip -> scaler.update
               -> zero_grad

Every operation is the one ``torch.autocast`` + ``torch.amp.GradScaler`` perform in the
official recipe, in the same order, so the result is bit-identical to that recipe.  The step
makes no host sync for optimizers that accept ``grad_scale``/``found_inf`` (fused Adam, AdamW,
SGD); for other optimizers exactly one remains: reading ``found_inf`` to decide whether to call
``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit.hooks import EngineHook, StepResult
from ampkit.policy import Fp32Policy, KeepFp32Rule
from ampkit.precision import Precision
from ampkit.scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler, warn_scaler_with_bf16

__all__ = ["MixedPrecision"]


@dataclass
class _OptState:
    checked: bool = False
    param_count: int = field(default=0)


class MixedPrecision:
    """Mixed-precision training engine.

    Args:
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"auto"`` or an alias (see ``Precision``).
        device: the device autocast runs on (``"auto"``: cuda, xpu, mps, then cpu).
        scaler: a ``LossScaler``, or ``"dynamic"``, ``"static"``, ``"none"``; default dynamic for
            fp16 and none for bf16/fp32.
        grad_accumulation: micro-batches per optimizer step.
        clip_grad_norm: max global L2 norm of the unscaled gradients, or None.
        keep_fp32: module name patterns or types to run in fp32 (applied by ``prepare``).
        skip_nonfinite: skip steps whose gradients hold inf/NaN even without loss scaling.
        hooks: ``EngineHook`` observers.
        telemetry: on-device step metrics and alarms (see ``ampkit.telemetry``).
        doctor: keep a cheap capture of each step and replay a failing one fully instrumented
            (see ``ampkit.diagnose.replay``).

    Example (the loop from the README, with a tiny model)::

    >>> import ampkit, torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    >>> mp = ampkit.MixedPrecision("bf16", device="cpu", grad_accumulation=2, clip_grad_norm=1.0)
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
        keep_fp32: Sequence[KeepFp32Rule] = (),
        skip_nonfinite: bool = True,
        hooks: Sequence[EngineHook] = (),
        telemetry: Any = None,
        doctor: bool = False,
    ) -> None:
        self.precision = Precision.parse(precision, device)
        self.device = self.precision.device
        if not (isinstance(grad_accumulation, int) and grad_accumulation >= 1):
            raise ValueError(
                f"MixedPrecision(grad_accumulation={grad_accumulation!r}): must be an int >= 1 "
                "(the number of micro-batches per optimizer step)"
            )
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"MixedPrecision(clip_grad_norm={clip_grad_norm!r}): must be > 0, or None to not clip")
        self.grad_accumulation = grad_accumulation
        self.clip_grad_norm = clip_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.scaler = self._make_scaler(scaler)
        self.scaler._ensure_state(self.device)
        self.policy = Fp32Policy(keep_fp32, self.device.type)
        self.hooks: list[EngineHook] = list(hooks)
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
        self.found_inf_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by ``ampkit.distributed``: makes every rank take the same skip decision.

        While one is set, each rank checks only its local gradient shards (``DTensor.to_local``)
        and the reducer makes the result global.  It may return before its collective completes
        if it has a ``wait()`` method: the engine calls ``wait()`` after clipping, right before
        the step-or-skip decision reads ``found_inf``."""
        self.telemetry: Any = None
        self.doctor: Any = None
        if telemetry is not None:
            from ampkit.telemetry import make_telemetry

            self.telemetry = make_telemetry(telemetry, self)
            self.hooks.append(self.telemetry)
        if doctor:
            from ampkit.diagnose.live import ReplayDoctor

            self.doctor = ReplayDoctor(self)
            self.hooks.append(self.doctor)

    # -- construction helpers ------------------------------------------------------------------
    def _make_scaler(self, scaler: LossScaler | str | None) -> LossScaler:
        if scaler is None:
            return DynamicLossScaler() if self.precision.needs_loss_scaling else NoLossScaler()
        if isinstance(scaler, str):
            choices = {"dynamic": DynamicLossScaler, "static": StaticLossScaler, "none": NoLossScaler}
            if scaler not in choices:
                raise ValueError(f"scaler={scaler!r}: use one of {sorted(choices)} or a LossScaler instance")
            scaler = choices[scaler]()
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                f"scaler={scaler!r} is not an ampkit LossScaler; pass ampkit.DynamicLossScaler(...) "
                "(a torch.amp.GradScaler's state can be loaded into one with load_state_dict)"
            )
        if scaler.enabled and self.precision.name == "bf16":
            warn_scaler_with_bf16()
        return scaler

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
        """Check ``model`` against the engine and apply the keep-fp32 policy; returns ``model``."""
        self._check_module(model)
        self.policy.apply(model)
        if all(m is not model for m in self.models):
            self.models.append(model)
            for hook in self.hooks:
                hook.on_prepare(self, model)
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """``model.no_sync()`` inside an accumulation window for DDP models, else a null context."""
        if not self.sync_gradients and hasattr(model, "no_sync"):
            return model.no_sync()  # type: ignore[operator,no-any-return]
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """Divide by ``grad_accumulation``, scale (fp16), and run backward.

        Call it once per loss; several losses per step are fine.  Keyword arguments go to
        ``Tensor.backward`` (``retain_graph``, ``inputs``).
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"mp.backward(loss) needs a tensor, got {type(loss).__name__}")
        if self.precision.autocast_enabled and torch.is_autocast_enabled(self.device.type):
            self._warn_once(
                "backward_in_autocast",
                "mp.backward() was called inside mp.autocast(): backward ops run in the dtype their "
                "forward ops chose, so autocast gains nothing here and may cast more; move the "
                "backward call out of the `with mp.autocast():` block",
            )
        for hook in self.hooks:
            hook.on_backward(self, loss)
        if self.grad_accumulation > 1:
            loss = loss / self.grad_accumulation
        if self.scaler.enabled or self.skip_nonfinite:
            # A NaN loss can have finite gradients (log of a negative value): remember it so the
            # step is skipped too.  A few scalar kernels, no host sync.
            bad = (~torch.isfinite(loss.detach())).any().to(device=self.device, dtype=torch.float32)
            self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite + bad
        self.scaler.scale(loss).backward(**backward_kwargs)

    def step(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> StepResult:
        """Count one micro-batch; at the boundary unscale, clip, step or skip, update, zero_grad."""
        opts = self._as_list(optimizers)
        self.micro_step += 1
        if self.micro_step < self.grad_accumulation:
            return StepResult(boundary=False, optimizer_step=self.optimizer_steps)
        self.micro_step = 0
        for opt in opts:
            self._check_optimizer(opt)
        scale = self.scale
        per_opt_found = [self._unscale(opt) for opt in opts]
        if self._loss_nonfinite is not None:
            for found in per_opt_found:
                # Fused optimizers skip only when found_inf == 1.0 exactly (and subtract it from
                # their step counter), so the flag is merged with max, never summed.
                torch.maximum(found, self._loss_nonfinite.clamp(max=1.0), out=found)
            self._loss_nonfinite = None
        for hook in self.hooks:
            hook.after_unscale(self, opts)
        if self.found_inf_reducer is not None:
            per_opt_found = [self.found_inf_reducer(f) for f in per_opt_found]
        grad_norm = self._clip_and_norm(opts)
        wait = getattr(self.found_inf_reducer, "wait", None)
        if wait is not None:
            wait()  # an asynchronous reduction overlapped the clip above; found_inf is read next
        found_inf = per_opt_found[0] if len(per_opt_found) == 1 else torch.stack(per_opt_found).sum()
        for hook in self.hooks:
            hook.before_optimizer_step(self, opts, found_inf, grad_norm)
        for opt, found in zip(opts, per_opt_found):
            self._step_or_skip(opt, found)
        # The update reads found_inf after the steps, matching GradScaler.update's order.
        scale_used = scale.clone() if self.scaler.enabled else scale
        self.scaler.update(found_inf)
        self.optimizer_steps += 1
        result = StepResult(
            boundary=True, found_inf=found_inf, grad_norm=grad_norm, scale=scale_used,
            optimizer_step=self.optimizer_steps,
        )
        for hook in self.hooks:
            hook.after_step(self, result, opts)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        return result

    def scheduler_step(self, scheduler: Any, result: StepResult) -> bool:
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
        return {
            "precision": self.precision.name,
            "grad_accumulation": self.grad_accumulation,
            "micro_step": self.micro_step,
            "optimizer_steps": self.optimizer_steps,
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("precision")
        if saved is not None and saved != self.precision.name:
            raise ValueError(
                f"this engine state was saved with precision={saved!r} but the engine runs "
                f"{self.precision.name!r}; build MixedPrecision({saved!r}, ...) to resume it, or start "
                "the new precision without loading the engine state"
            )
        micro = int(state_dict.get("micro_step", 0))
        if micro and int(state_dict.get("grad_accumulation", self.grad_accumulation)) != self.grad_accumulation:
            raise ValueError(
                f"the checkpoint was saved mid-window ({micro} of {state_dict['grad_accumulation']} "
                f"micro-batches) but this engine accumulates {self.grad_accumulation}; resume with the "
                "same grad_accumulation or save at a boundary"
            )
        self.micro_step = micro
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        if state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
            self.scaler._ensure_state(self.device)

    # -- internals ---------------------------------------------------------------------------------
    @staticmethod
    def _as_list(optimizers: Any) -> list[torch.optim.Optimizer]:
        if isinstance(optimizers, torch.optim.Optimizer):
            opts = [optimizers]
        else:
            try:
                opts = list(optimizers)
            except TypeError:
                opts = []
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError(
                f"mp.step() takes a torch.optim.Optimizer or a list of them, got {optimizers!r}"
            )
        return opts

    @staticmethod
    def _grads(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]

    def _unscale(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.scaler.enabled or self.skip_nonfinite:
            grads = self._grads(opt)
            if self.found_inf_reducer is not None:
                # The reducer makes found_inf global, so check this rank's shards only; a sharded
                # (DTensor) gradient would otherwise run one blocking all-reduce per dtype group.
                with torch.no_grad():  # to_local() then returns the shard itself, no autograd node
                    grads = [_local_shard(g) for g in grads]
            self.scaler.unscale_(grads, found_inf)
        return found_inf

    def _clip_and_norm(self, opts: Sequence[torch.optim.Optimizer]) -> torch.Tensor | None:
        params = [p for opt in opts for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return None
        if self.clip_grad_norm is not None:
            # Same call as the recipe, so the clipped gradients match bit for bit.
            return torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm, foreach=None)
        grads = [p.grad for p in params if p.grad is not None]
        norms = torch._foreach_norm(grads)
        return torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))

    def _step_or_skip(self, opt: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        if getattr(opt, "_step_supports_amp_scaling", False):
            # Fused kernels read found_inf on the device and skip the update themselves: no sync.
            # grad_scale=None: the gradients were already unscaled above.
            opt.grad_scale = None  # type: ignore[attr-defined]
            opt.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.grad_scale  # type: ignore[attr-defined]
                del opt.found_inf  # type: ignore[attr-defined]
            return
        if not (self.scaler.enabled or self.skip_nonfinite):
            opt.step()
            return
        # The one host sync of a non-fused step: the optimizer cannot skip by itself.
        if not found_inf.item():
            opt.step()

    def _check_optimizer(self, opt: torch.optim.Optimizer) -> None:
        state = self._opt_states.setdefault(id(opt), _OptState())
        count = sum(len(g["params"]) for g in opt.param_groups)
        if state.checked and state.param_count == count:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                self._check_param(p, where=f"{type(opt).__name__} param_groups")
            eps = group.get("eps")
            if isinstance(eps, float):
                _check_eps(opt, eps, {p.dtype for p in group["params"]})
        state.checked, state.param_count = True, count

    def _check_module(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            self._check_param(p, where=f"parameter {name!r}")

    def _check_param(self, p: torch.Tensor, where: str) -> None:
        if p.device.type == "meta":
            raise RuntimeError(
                f"{where} is on the meta device (allocated without storage), so it cannot be trained; "
                f"materialise the model first with model.to_empty(device={str(self.device)!r}) and load "
                "or initialise its weights"
            )
        if p.device.type != self.device.type:
            raise RuntimeError(
                f"{where} lives on {p.device} but the engine was built for {self.device}; move the model "
                f"with model.to({str(self.device)!r}) before building the optimizer, or build "
                f"MixedPrecision(..., device={p.device.type!r})"
            )
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) and self.scaler.enabled:
            raise TypeError(
                f"{where} is a trainable {_dtype_name(p.dtype)} parameter, but fp16 loss scaling needs fp32 "
                "master weights: small updates round away in fp16 and unscaling fp16 gradients "
                "overflows. Keep the model in fp32 (drop model.half() / .to(torch.float16)) and let "
                "mp.autocast() run the math in fp16 (ampkit finding LOW_PRECISION_PARAMS)"
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def __repr__(self) -> str:
        return (
            f"MixedPrecision({self.precision.name!r}, device={str(self.device)!r}, "
            f"scaler={type(self.scaler).__name__}, grad_accumulation={self.grad_accumulation}, "
            f"clip_grad_norm={self.clip_grad_norm})"
        )

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - guard against `for x in mp`
        raise TypeError("MixedPrecision is not iterable; use mp.autocast(), mp.backward(loss), mp.step(opt)")


def _local_shard(grad: torch.Tensor) -> torch.Tensor:
    # DTensor.to_local() returns the shard's own tensor, so unscaling it in place unscales the grad.
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def _check_eps(opt: torch.optim.Optimizer, eps: float, dtypes: set[torch.dtype]) -> None:
    for dtype in dtypes:
        if not dtype.is_floating_point or dtype == torch.float32 or dtype == torch.float64:
            continue
        stored = float(torch.tensor(eps, dtype=dtype))
        if eps > 0 and (stored == 0.0 or abs(stored - eps) / eps > 0.01):
            tiny = torch.finfo(dtype).tiny
            raise ValueError(
                f"{type(opt).__name__}(eps={eps:g}) cannot be represented in {_dtype_name(dtype)} parameters "
                f"(it becomes {stored:g}), so the update can divide by zero and go inf/NaN. Keep the "
                f"parameters in fp32, or use eps >= {tiny:g} (the smallest normal {_dtype_name(dtype)})"
            )
