"""Replay a captured forward of a user's model under the op-level diagnosis.

The training script's loss function is unknown to the doctor, so a replay re-runs the root
model on the captured inputs, with the captured RNG state and autocast state, and starts
backward from the model's outputs with the gradient they received in the user's own backward
(``OutputGradProgram``).  When that gradient was rounded to fp16/bf16 by a cast right after the
model (autocast's fp32 loss ops, ``.float()``), the gradient from *before* the cast is used,
so an overflow at that boundary is reproduced, and judged at scale 1, exactly.  Entries made
non-finite by a non-finite forward are zeroed (``usable_seed``), so the keep-fp32 bisection can
tell a fixed forward from a broken one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.script.capture import Capture
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.step.api import diagnose_program
from ampkit.diagnose.step.programs import OutputGradProgram, usable_seed
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.diagnose.step.session import RngSnapshot, Session
from ampkit.precision import LOW_PRECISION_DTYPES, Precision

__all__ = ["framework_autocast_off", "replay_capture", "replay_precision"]


def replay_precision(cap: Capture, intended: str | None) -> tuple[str, torch.dtype, bool] | None:
    """(precision name, autocast dtype, autocast on) to replay ``cap`` with, or None for an fp32 forward.

    The capture's own autocast state wins; half parameters replay without autocast; an fp32
    forward replays under ``intended`` (``--precision``) when given.
    """
    if cap.autocast_enabled and cap.autocast_dtype in LOW_PRECISION_DTYPES:
        return dtype_name(cap.autocast_dtype), cap.autocast_dtype, True
    if cap.param_dtype in LOW_PRECISION_DTYPES:
        assert cap.param_dtype is not None
        return dtype_name(cap.param_dtype), cap.param_dtype, False
    if intended and intended != "fp32":
        prec = Precision.parse(intended, cap.device)
        if prec.dtype in LOW_PRECISION_DTYPES:
            return prec.name, prec.dtype, True
    return None


def replay_capture(cap: Capture, *, intended: str | None = None, step: int | None = None,
                   user_paths: Sequence[str] = (), bisect: bool = True,
                   on_progress: Callable[[str], None] | None = None) -> DiagnosisResult | None:
    """Diagnose the captured forward (+ its backward) op by op; None when it ran in fp32.

    The replay runs with inference mode off, on normal copies of the tensors a forward under
    ``torch.inference_mode`` captured (an eval pass after training, Lightning's ``trainer.test()``):
    autograd refuses to save inference tensors for backward, and the fp32 shadow needs them.  The
    copies cost one clone of that batch, on the replay path only.  ``on_progress`` is told what a
    long keep-fp32 search is doing (``Session.on_progress``).
    """
    how = replay_precision(cap, intended)
    if how is None:
        return None
    name, dtype, autocast_on = how
    with torch.inference_mode(False):
        return _replay(cap, name, dtype, autocast_on, step=step, user_paths=user_paths, bisect=bisect,
                       on_progress=on_progress)


def _replay(cap: Capture, name: str, dtype: torch.dtype, autocast_on: bool, *, step: int | None,
            user_paths: Sequence[str], bisect: bool, on_progress: Callable[[str], None] | None) -> DiagnosisResult:
    scale = float(cap.scale) if cap.scale is not None else 1.0
    grads = [usable_seed(_normal(g32 if g32 is not None else g), scale) for g, g32 in zip(cap.grads, cap.grads_fp32)]
    program = OutputGradProgram(tree_map(_normal, cap.args), tree_map(_normal, cap.kwargs), grads,
                                loss_scale=scale, autocast=(cap.device.type, dtype, autocast_on))
    precision = Precision.parse(name, cap.device)
    rng = RngSnapshot(cap.device, cpu=cap.rng_cpu, accel=cap.rng_device)
    with cap.running_stats_before():
        session = Session(cap.root, program, precision, user_paths=tuple(user_paths), rng=rng,
                          call_site=cap.location, on_progress=on_progress)
    try:
        with framework_autocast_off(cap.entered_inside):
            return diagnose_program(cap.root, program, precision, step=step, bisect=bisect,
                                    user_paths=user_paths, session=session)
    finally:
        session.close()


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
    patches = PatchSet()

    def enter(orig: Callable[..., Any]) -> Callable[..., Any]:
        def __enter__(ac: Any) -> Any:
            frame = sys._getframe(1)
            if id(ac) in instances or (frame.f_code.co_filename, frame.f_lineno) in lines:
                skipped[id(ac)] = skipped.get(id(ac), 0) + 1
                return None
            return orig(ac)
        return __enter__

    def exit_(orig: Callable[..., Any]) -> Callable[..., Any]:
        def __exit__(ac: Any, *exc: Any) -> Any:
            if skipped.get(id(ac), 0) > 0:
                skipped[id(ac)] -= 1
                return False
            return orig(ac, *exc)
        return __exit__

    cls = torch.amp.autocast_mode.autocast
    patches.wrap(cls, "__enter__", enter)
    patches.wrap(cls, "__exit__", exit_)
    try:
        yield
    finally:
        patches.restore()
