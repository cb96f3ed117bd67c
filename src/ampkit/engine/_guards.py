"""Construction-time checks of the engine's inputs: parameters, optimizer ``eps`` and ``step`` signature.

They run once per model (``prepare``) and once per optimizer layout (the first boundary), never
per step, and raise with the call echoed and the fix.

>>> import torch
>>> check_param(torch.zeros(2, requires_grad=True), where="w", device=torch.device("cpu"), scaled=True)
>>> check_eps(torch.optim.Adam([torch.zeros(1, dtype=torch.float16)]), 1e-8, {torch.float16})
Traceback (most recent call last):
...
ValueError: Adam(eps=1e-08) cannot be represented in fp16 parameters (it becomes 0), so the update can divide by zero and go inf/NaN. Keep the parameters in fp32, or use eps >= 6.10352e-05 (the smallest normal fp16)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from ampkit._util.dtypes import dtype_name
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = [
    "check_amp_step",
    "check_backward_loss",
    "check_eps",
    "check_no_closure",
    "check_optimizer",
    "check_param",
    "no_gradients_error",
    "requires_closure",
]


def check_param(p: torch.Tensor, *, where: str, device: torch.device, scaled: bool) -> None:
    """Raise when ``p`` cannot be trained by an engine on ``device`` (``scaled``: fp16 loss scaling)."""
    if p.device.type == "meta":
        raise RuntimeError(
            f"{where} is on the meta device (allocated without storage), so it cannot be trained; "
            f"materialise the model first with model.to_empty(device={str(device)!r}) and load "
            "or initialise its weights"
        )
    if p.device.type != device.type:
        raise RuntimeError(
            f"{where} lives on {p.device} but the engine was built for {device}; move the model "
            f"with model.to({str(device)!r}) before building the optimizer, or build "
            f"MixedPrecision(..., device={p.device.type!r})"
        )
    if p.requires_grad and p.dtype in LOW_PRECISION_DTYPES and scaled:
        raise TypeError(
            f"{where} is a trainable {dtype_name(p.dtype)} parameter, but fp16 loss scaling needs fp32 "
            "master weights: small updates round away in fp16 and unscaling fp16 gradients "
            "overflows. Keep the model in fp32 (drop model.half() / .to(torch.float16)) and let "
            "mp.autocast() run the math in fp16 (ampkit finding LOW_PRECISION_PARAMS)"
        )


def check_optimizer(opt: torch.optim.Optimizer, *, device: torch.device, scaled: bool) -> None:
    """Raise when ``opt`` cannot be stepped by an engine: its ``step`` signature, each parameter, each ``eps``."""
    check_amp_step(opt)
    where = f"{type(opt).__name__} param_groups"
    for group in opt.param_groups:
        for p in group["params"]:
            check_param(p, where=where, device=device, scaled=scaled)
        eps = group.get("eps")
        if isinstance(eps, float):
            check_eps(opt, eps, {p.dtype for p in group["params"]})


def check_backward_loss(leaves: Sequence[torch.Tensor], *, seeded: bool) -> None:
    """Raise, before any hook or engine state sees them, for losses backward would refuse.

    Torch refuses them only inside ``backward``, after the hooks recorded the loss (telemetry would
    count a loss that trained nothing) and after the engine noted a NaN one (the next good step would
    be skipped for it).  ``seeded``: the call passes explicit gradients (``gradient=`` /
    ``grad_tensors=``), so a loss need not be a scalar.  Attribute reads only: no kernel, no sync.
    """
    for i, leaf in enumerate(leaves):
        what = "loss" if len(leaves) == 1 else f"loss tensor {i} (depth first)"
        if not leaf.requires_grad:
            raise RuntimeError(
                f"mp.backward(loss): the {what} needs no gradient (requires_grad=False, no grad_fn), so "
                "there is nothing to train through it; nothing was recorded or changed. Compute the loss "
                "from the model's output outside torch.no_grad() and without .detach() (or .item()), or "
                "do not pass a loss that trains nothing to mp.backward"
            )
        if not seeded and leaf.numel() != 1:
            raise RuntimeError(
                f"mp.backward(loss): the {what} has shape {tuple(leaf.shape)}, but backward without explicit "
                "gradients needs a scalar (one element); nothing was recorded or changed. Reduce it "
                "first (loss.mean() or loss.sum())"
            )


def no_gradients_error(opts: Sequence[torch.optim.Optimizer]) -> RuntimeError:
    """The error for a step whose optimizers hold no gradient at all: no backward before it.

    GradScaler raises here too ("No inf checks were recorded").  The engine knows the case from the
    gradient norm it computes anyway (None when no parameter has a gradient), so no extra scan.
    """
    names = ", ".join(type(opt).__name__ for opt in opts)
    return RuntimeError(
        f"mp.step({names}) found no gradient on any parameter: call mp.backward(loss) before mp.step(), "
        "and once per step (mp.step() zeroes the gradients after each optimizer step)"
    )


def check_eps(opt: torch.optim.Optimizer, eps: float, dtypes: set[torch.dtype]) -> None:
    """Raise when ``eps`` rounds to 0 (or by more than 1%) in a low-precision parameter dtype."""
    for dtype in dtypes:
        if not dtype.is_floating_point or dtype == torch.float32 or dtype == torch.float64:
            continue
        stored = float(torch.tensor(eps, dtype=dtype))
        if eps > 0 and (stored == 0.0 or abs(stored - eps) / eps > 0.01):
            tiny = torch.finfo(dtype).tiny
            raise ValueError(
                f"{type(opt).__name__}(eps={eps:g}) cannot be represented in {dtype_name(dtype)} parameters "
                f"(it becomes {stored:g}), so the update can divide by zero and go inf/NaN. Keep the "
                f"parameters in fp32, or use eps >= {tiny:g} (the smallest normal {dtype_name(dtype)})"
            )


def check_amp_step(opt: torch.optim.Optimizer) -> None:
    """Raise when ``opt`` declares ``_step_supports_amp_scaling`` and its ``step`` takes ``grad_scaler``.

    ``GradScaler.step`` passes itself as ``grad_scaler=`` to such an optimizer (a protocol torch
    deprecates) and then neither unscales nor skips for it: the optimizer does both through the
    GradScaler.  The engine has no GradScaler to pass, and an optimizer written for one would run
    without it, so it is refused before its first step, with the two ways to fix it.
    """
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return
    try:
        params = inspect.signature(opt.step).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing declares grad_scaler
        return
    if "grad_scaler" not in params:
        return
    name = type(opt).__name__
    raise TypeError(
        f"{name}.step() takes grad_scaler=, the keyword through which torch.amp.GradScaler hands itself to "
        f"optimizers with _step_supports_amp_scaling = True; ampkit unscales and skips without a GradScaler, "
        f"so {name} would get none. Either make {name}.step() read the tensors the engine sets on the "
        "optimizer during the step, as torch's fused optimizers do: self.grad_scale (None: the gradients "
        "are already unscaled) and self.found_inf (> 0: leave parameters and state unchanged), and drop "
        "its grad_scaler parameter; or set optimizer._step_supports_amp_scaling = False, and the engine "
        "unscales the gradients and skips the step for it"
    )


def requires_closure(opt: torch.optim.Optimizer) -> bool:
    """True when ``type(opt).step`` takes a ``closure`` without a default (torch's LBFGS).

    Read from the signature once per optimizer class (cached), so the check costs a dict lookup
    per step.  A ``step`` without a readable signature (a builtin) is taken not to need one.
    """
    return _step_requires_closure(type(opt))  # type: ignore[arg-type]  # classes hash by identity; typeshed disagrees


@functools.cache
def _step_requires_closure(cls: type) -> bool:
    try:
        param = inspect.signature(cls.step).parameters.get("closure")  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


_CLOSURE_FIX = (
    "a closure re-evaluates the loss and its gradients several times inside one optimizer step, and "
    "the engine unscales, checks and clips only the gradients it is handed, once, so loss scaling would "
    "have to wrap every evaluation (torch.amp.GradScaler refuses closures for the same reason). Without "
    "a loss scaler (bf16, fp32), call opt.step(closure) yourself, with the forward inside mp.autocast() "
    "and a plain loss.backward() in the closure, instead of mp.backward() and mp.step(); with fp16, "
    "use an optimizer that steps without a closure (SGD, Adam, AdamW)"
)


def check_no_closure(opts: Sequence[torch.optim.Optimizer], closure: object) -> None:
    """Raise, before anything moves, for ``mp.step(opt, closure)`` or an optimizer that needs a closure."""
    if closure is not None:
        raise TypeError(f"mp.step(optimizer, closure) is not supported: {_CLOSURE_FIX}")
    for opt in opts:
        if requires_closure(opt):
            name = type(opt).__name__
            raise TypeError(f"mp.step({name}) cannot step {name}: its step(closure) needs a closure; {_CLOSURE_FIX}")
