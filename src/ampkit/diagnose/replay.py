"""Replay a captured forward (``diagnose.capture.Capture``) under the op-level diagnosis.

The training code's loss function is unknown to the doctor, so a replay re-runs the root model on the
captured inputs, with the captured RNG state and autocast state, and starts backward from the model's
outputs with the gradient they received in the training step (``OutputGradProgram``).  When that
gradient was rounded to fp16/bf16 by a cast right after the model (autocast's fp32 loss ops,
``.float()``), the gradient from *before* the cast is used, so an overflow at that boundary is
reproduced, and judged at scale 1, exactly.  Entries made non-finite by a non-finite forward are
zeroed (``usable_seed``), so the keep-fp32 bisection can tell a fixed forward from a broken one.

Every replay, whoever asks for it, also:

* starts from the running statistics the model had before the captured forward (a skipped step does
  not undo its forward's update, and a NaN it wrote would read as an earlier step's);
* runs with inference mode and the caller's autocast off and gradients on (a replay can start inside
  the caller's ``inference_mode``, autocast region or a forward pre-hook; every run sets its own), on
  normal copies of inference tensors among the inputs (autograd refuses to save those for backward, and
  the fp32 shadow needs them; one clone of that batch, on the replay path only);
* switches off the autocast a framework entered inside the model's forward (``Capture.entered_inside``):
  the replay applies it around the forward itself, and its FP32 shadow and keep-fp32 trials must be
  able to switch it off.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.step.api import diagnose_program
from ampkit.diagnose.step.programs import OutputGradProgram, usable_seed
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.diagnose.step.session import RngSnapshot, Session
from ampkit.precision import LOW_PRECISION_DTYPES, Precision

__all__ = ["framework_autocast_off", "replay", "replay_precision", "replay_program"]


def replay_precision(cap: Capture, intended: str | None) -> tuple[Precision, tuple[str, torch.dtype, bool]] | None:
    """(precision, autocast state) to replay ``cap`` with when the caller has no precision of its own (the
    script doctor), or None for an fp32 forward.

    The capture's own autocast state wins; half parameters replay without autocast; an fp32 forward
    replays under ``intended`` (``--precision``) when given.
    """
    if cap.autocast_enabled and cap.autocast_dtype in LOW_PRECISION_DTYPES:
        name, dtype, on = dtype_name(cap.autocast_dtype), cap.autocast_dtype, True
    elif cap.param_dtype is not None and cap.param_dtype in LOW_PRECISION_DTYPES:
        name, dtype, on = dtype_name(cap.param_dtype), cap.param_dtype, False
    elif intended and intended != "fp32" and (prec := Precision.parse(intended, cap.device)).dtype in LOW_PRECISION_DTYPES:
        name, dtype, on = prec.name, prec.dtype, True
    else:
        return None
    return Precision.parse(name, cap.device), (cap.device.type, dtype, on)


def replay(cap: Capture, precision: Precision, *, shadow: bool = True, bisect: bool = True, step: int | None = None,
           autocast: tuple[str, torch.dtype, bool] | None = None, loss_scale: float | None = None,
           sqnr_threshold_db: float | None = None, user_paths: Sequence[str] = (),
           on_progress: Callable[[str], None] | None = None) -> DiagnosisResult:
    """Diagnose the captured forward (+ its backward) op by op under ``precision``.

    ``autocast`` (device type, dtype, enabled) replaces the captured autocast state (the script doctor
    replays an fp32 forward under ``--precision``), and ``loss_scale`` the captured scale (preflight
    replays fp16 at the scaler's initial scale); ``user_paths`` and ``on_progress`` go to the
    ``Session``; ``shadow``, ``bisect`` and ``sqnr_threshold_db`` to ``diagnose_program``.
    """
    program = replay_program(cap, autocast=autocast, loss_scale=loss_scale)
    rng = RngSnapshot(cap.device, cpu=cap.rng_cpu, accel=cap.rng_device)
    with contextlib.ExitStack() as clean:
        clean.enter_context(torch.inference_mode(False))
        clean.enter_context(torch.enable_grad())
        clean.enter_context(torch.autocast(cap.device.type, enabled=False))
        with cap.running_stats_before():  # the session's copy starts from them; the model gets its own back
            session = Session(cap.root, program, precision, user_paths=tuple(user_paths), rng=rng,
                              call_site=cap.location, on_progress=on_progress)
        try:
            with framework_autocast_off(cap.entered_inside):
                return diagnose_program(cap.root, program, precision, step=step, shadow=shadow, bisect=bisect,
                                        user_paths=user_paths, session=session, sqnr_threshold_db=sqnr_threshold_db)
        finally:
            session.close()


def replay_program(cap: Capture, *, autocast: tuple[str, torch.dtype, bool] | None = None,
                   loss_scale: float | None = None) -> OutputGradProgram:
    """The step program that re-runs ``cap``'s forward and starts backward from its outputs' gradients, at the
    captured scale or at ``loss_scale`` (the gradients rescaled to it), under ``autocast`` or the captured state."""
    captured = 1.0 if cap.scale is None else float(cap.scale)  # a host read of a 0-d tensor: replay path only
    grads = [usable_seed(_normal(g), captured) for g in cap.seed_grads()]
    scale = captured if loss_scale is None else float(loss_scale)
    if scale != captured:
        grads = [None if g is None else g.float() * (scale / captured) for g in grads]
    return OutputGradProgram(tree_map(_normal, cap.args), tree_map(_normal, cap.kwargs), grads, loss_scale=scale,
                             autocast=autocast or cap.autocast)


def _normal(x: Any) -> Any:
    """A normal tensor for an inference tensor (autograd cannot save those); anything else as it is."""
    return x.clone() if isinstance(x, torch.Tensor) and x.is_inference() else x


@contextlib.contextmanager
def framework_autocast_off(markers: Sequence[Any]) -> Iterator[None]:
    """Make the autocast entries a framework put inside the model's forward (``Capture.entered_inside``)
    no-ops while the replay runs: the replay applies that autocast around the forward itself, and its
    FP32 shadow and keep-fp32 trials must be able to switch it off, which a wrapper that re-enters
    autocast inside ``forward`` would undo (Accelerate's ``convert_outputs_to_fp32(autocast(forward))``)."""
    if not markers:
        yield
        return
    instances = {id(m) for m in markers if not isinstance(m, tuple)}
    lines = {m for m in markers if isinstance(m, tuple)}
    skipped: dict[int, int] = {}
    cls = torch.amp.autocast_mode.autocast
    enter, exit_ = cls.__enter__, cls.__exit__

    def __enter__(ac: Any) -> Any:
        frame = sys._getframe(1)
        if id(ac) in instances or (frame.f_code.co_filename, frame.f_lineno) in lines:
            skipped[id(ac)] = skipped.get(id(ac), 0) + 1
            return None
        return enter(ac)

    def __exit__(ac: Any, *exc: Any) -> Any:
        if skipped.get(id(ac), 0) > 0:
            skipped[id(ac)] -= 1
            return False
        return exit_(ac, *exc)

    # Class attributes of torch's autocast, put back on the way out (the script doctor's own patches of
    # the same methods, when installed, are what ``enter``/``exit_`` call).
    cls.__enter__, cls.__exit__ = __enter__, __exit__  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_  # type: ignore[method-assign]
