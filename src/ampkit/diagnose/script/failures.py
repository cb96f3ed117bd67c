"""The step events the watchers report, as functions of the ``RunState``, and the failures worth a replay
they turn into: a step the GradScaler skipped (``found_read``), a non-finite loss (``loss_read``),
non-finite gradients at a step no scaler guards (``grads_read``).  Each failure goes to
``state.on_failure`` (the runner replays it) while the model still holds that step's weights; one whose
cause lies in the loss code outside every model is followed on the loss side (``loss_code_nonfinite``,
``boundary_overflow``: ``script.losstrace``, ``script.lossgrad``).

Sampling (what keeps an unproblematic script within 1.5x of its plain run time): the first
``Sampler.warmup`` iterations, every ``Sampler.period``-th one, and a few after any failure are
*dense* (``end_iteration``): global module hooks discover models, normalisation statistics are
checked, and deferred device reads are flushed.  The other iterations pay only for the wrappers
(a few Python calls per step) and the root-model hooks (two hook calls per forward).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ampkit._util.dtypes import dtype_name
from ampkit._util.threads import thread_values
from ampkit.diagnose.capture import Capture, running_stats
from ampkit.diagnose.core.modules import float_tensors
from ampkit.diagnose.script.lossgrad import LossGrads, loss_grad_text
from ampkit.diagnose.script.losstrace import HIDDEN_LOSS_CODE, LossSideTrace, hidden_code_text, loss_code_text
from ampkit.diagnose.script.state import Failure, FailureCause, RunState, SkipCause
from ampkit.findings import Code, Finding, nonfinite_input

__all__ = [
    "arm_loss_trace", "boundary_overflow", "check_norm_stats", "close_loss_trace", "end_iteration", "found_read",
    "grads_read", "hidden_loss_code", "loss_code_nonfinite", "loss_read", "open_loss_trace", "reclassify",
    "taped_loss_code",
]


def end_iteration(state: RunState) -> None:
    """The primary optimizer stepped (or was skipped): a new iteration begins."""
    close_loss_trace(state, final=False)
    state.tapes.end()
    state.count_step()
    models = state.models
    thread_values(models).step = state.step  # per-step: a write with no Python frame
    window = models.new_window()
    dense = state.sampler.dense(state.iteration)
    models.set_discovery(dense)
    if dense:
        models.refresh_roots()
        check_norm_stats(state)
        state.pending.flush()
    if state.on_step is not None:
        state.on_step(window)


def loss_read(state: RunState, it: int, nonfinite: bool) -> None:
    """The loss of step ``it`` was read back (at a step no GradScaler guards)."""
    if not nonfinite:
        return
    state.loss_nonfinite.add(it)
    caps = state.models.captures
    scaled = any(c.scale is not None for c in caps)
    if _consequence(state, it):
        return
    if not scaled and it == state.step:
        cause: FailureCause = "nonfinite_data" if _inputs_nonfinite(state, caps, it) else "nonfinite_loss"
        _fail(state, Failure("nonfinite_loss", it, cause, list(caps)))


def grads_read(state: RunState, it: int, nonfinite: bool) -> None:
    """Non-finite gradients at an unguarded optimizer step (the weights are about to be corrupted)."""
    if not nonfinite or it != state.step:
        return
    if _consequence(state, it):
        return
    caps = state.models.captures
    cause: FailureCause = "nonfinite_data" if _inputs_nonfinite(state, caps, it) else "gradient_overflow"
    _fail(state, Failure("nonfinite_grads", it, cause, list(caps)))


def found_read(state: RunState, optimizer: torch.optim.Optimizer, found: torch.Tensor, scale: torch.Tensor,
               primary: bool) -> None:
    """A guarded step (``GradScaler.step`` or an ampkit engine's) produced ``found``: keep it for the
    scheduler rule and judge it (read at once where the step already synced on it, else deferred)."""
    it = state.step
    state.optimizers.info(optimizer).last_found = (found, it)
    caps = list(state.models.captures)

    def judge(v: float) -> None:
        if v <= 0 or (not primary and it in state.skips):
            return
        live = it == state.step
        cause = _classify(state, caps if live else [], it)
        state.skips[it] = cause
        if live:
            check_norm_stats(state, after_skip=True)
            _fail(state, Failure("skip", it, cause, caps, float(scale)))
    # Non-fused optimizers: the scaler already synced on found_inf to decide the step, reading it is free.
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or state.sampler.dense(state.iteration):
        judge(float(found))
    else:
        state.pending.read(found, judge)


def reclassify(state: RunState, it: int, cause: SkipCause) -> None:
    """A replay showed what really made step ``it`` fail (e.g. a forward overflow behind a finite loss)."""
    if it in state.skips:
        state.cause_of[state.skips[it]] = cause
        state.skips[it] = cause


def check_norm_stats(state: RunState, after_skip: bool = False) -> None:
    """Read the models' normalisation statistics for non-finite values (deferred; NORM_STATS_NONFINITE)."""
    names = state.models.named_modules()
    it = state.step
    for mod, bufs in (layer for model in state.models.models() for layer in running_stats(model)):
        bad = torch.stack([(~torch.isfinite(b)).sum() for b in bufs]).sum()  # a device scalar, read deferred
        name = names.get(id(mod), type(mod).__name__)

        def judge(v: float, name: str = name) -> None:
            if v > 0 and name not in state.norm_bad:
                state.norm_bad[name] = (it, int(v), after_skip)
        state.pending.read(bad, judge)


def _fail(state: RunState, failure: Failure) -> None:
    state.sampler.boost(failure.step - 1)  # the Sampler counts from 0
    if state.on_failure is not None:
        state.on_failure(failure)


def _consequence(state: RunState, it: int) -> bool:
    """Whether a failure at step ``it`` follows from weights an earlier unguarded step made non-finite
    (``corrupted_by``): its non-finite inputs are folded into that finding, and it is not diagnosed again."""
    if state.corrupted_by is None or it <= state.corrupted_by[2]:
        return False
    _inputs_nonfinite(state, state.models.captures, it)
    return True


def _classify(state: RunState, caps: list[Capture], it: int) -> FailureCause:
    if _inputs_nonfinite(state, caps, it):
        return "nonfinite_data"
    if it in state.scalers.penalty_overflow:
        return "gradient_overflow"  # a loss made of gradients that overflowed at this scale
    if any(c.loss is not None and not bool(torch.isfinite(c.loss).all()) for c in caps):
        state.loss_nonfinite.add(it)  # read here, on the failure path, for scaled losses
    if it in state.loss_nonfinite:
        return "nonfinite_loss"
    if it in state.scalers.scaled_overflow:
        return "scaled_loss_overflow"
    return "gradient_overflow"


def _inputs_nonfinite(state: RunState, caps: list[Capture], it: int) -> bool:
    """NONFINITE_INPUT: non-finite values in a captured batch (a host read; failure path only)."""
    bad = False
    for cap in caps:
        for i, x in enumerate(float_tensors((cap.args, cap.kwargs))):
            rows = (~torch.isfinite(x.detach())).reshape(x.shape[0], -1).any(1) if x.dim() else \
                (~torch.isfinite(x.detach())).reshape(1)
            idx = rows.nonzero().flatten().tolist()
            if not idx:
                continue
            bad = True
            model = state.models.label(cap.root)
            root = state.corrupted_by
            if root is not None and it > root[2] and state.ledger.fold(
                    root[0], root[1], {"code": "NONFINITE_INPUT", "step": it, "model": model, "input": i,
                                       "samples": len(idx)}):
                continue  # computed by a model whose weights that step made NaN: not the data's fault
            message, fix = nonfinite_input(
                f"input #{i} of {model} ({tuple(x.shape)}, {dtype_name(x.dtype)}) holds NaN/inf in {len(idx)} "
                f"of {rows.numel()} samples (indices {idx[:8]}{' ...' if len(idx) > 8 else ''}) at step {it}, "
                "before any low-precision op runs")
            state.ledger.add(Finding(
                code="NONFINITE_INPUT", severity="error", message=message, fix=fix,
                location=cap.location, step=it,
                evidence={"input": i, "samples": idx[:32], "batch_size": int(rows.numel())},
            ), key=("input", model, i))
    return bad


# -- the loss side (``script.losstrace``) ---------------------------------------------------------------
def loss_code_nonfinite(state: RunState, cap: Capture, failure: Failure) -> None:
    """The loss went non-finite although the model's outputs were finite: the failing iteration's own
    loss-side calls (its tape, ``script.losstrace.LossSideTape``) name the op between the model and the
    loss that made the first bad value; without a tape the next iteration is traced; without either (the
    next loss was finite, or no iteration followed) the finding says where."""
    label = state.models.label(cap.root)
    loss = cap.loss
    nan = loss is not None and bool(torch.isnan(loss).any())
    became = "NaN" if nan else "inf"
    if taped_loss_code(state, label, became, failure.step):
        return

    def report(trace: LossSideTrace | None) -> None:
        first = trace.first if trace is not None else None
        if first is None:
            state.ledger.add(Finding(
                code="FORWARD_NAN" if nan else "FORWARD_OVERFLOW", severity="error",
                message=(f"the loss became {became} at step {failure.step} although the outputs of {label} "
                         "were finite: the op that produced it runs between the model and the loss (the loss "
                         "function or a post-processing step), in low precision"),
                fix="compute the loss from fp32 values: `loss_fn(output.float(), target)`, and guard "
                    "log/div/exp against zero and huge inputs",
                location=cap.location, step=failure.step), key=("loss-code", label))
            return
        state.ledger.add(Finding(
            code="FORWARD_NAN" if first.nan else "FORWARD_OVERFLOW", severity="error", op=first.op,
            step=failure.step, location=first.location, **loss_code_text(first, label, became, failure.step),
        ), key=("loss-code", label))

    arm_loss_trace(state, report)


def boundary_overflow(state: RunState, cap: Capture, failure: Failure) -> None:
    """The gradient was non-finite where it reached the model's outputs: the backward of the code
    between the model and the loss overflowed.  The next iteration's loss-side ops are followed
    into their backward (``script.lossgrad``) to name the op."""
    label = state.models.label(cap.root)
    state.boundary_overflows.append(failure.step)
    state.note_location("boundary_overflow", cap.location)
    state.note_location("boundary_model", label)
    if len(state.boundary_overflows) > 1:
        return

    def report(trace: LossSideTrace | None) -> None:
        bad = trace.grads.judge() if trace is not None and trace.grads is not None else None
        if bad is not None:
            state.ledger.add(Finding(code="BACKWARD_OVERFLOW", op=bad.op, step=failure.step,
                                     location=bad.location, **loss_grad_text(bad, label, failure.step)),
                             key="loss-code-backward")

    arm_loss_trace(state, report, grads_at_scale=float(cap.scale) if cap.scale is not None else 1.0)


def taped_loss_code(state: RunState, label: str, became: str, step: int) -> bool:
    """Report the op of ``step``'s own loss-side calls that made its non-finite loss; False without one."""
    first = state.tapes.first_bad(step)
    if first is not None:
        state.ledger.add(Finding(code="FORWARD_NAN" if first.nan else "FORWARD_OVERFLOW", severity="error",
                                 op=first.op, step=step, location=first.location,
                                 **loss_code_text(first, label, became, step, recorded=True)),
                         key=("loss-code", label))
    return first is not None


def hidden_loss_code(state: RunState, label: str, failure: Failure) -> bool:
    """Report the op of the failing step's own loss-side calls that made an inf/NaN the loss hid (a where,
    a clip) and the backward met (0 * inf): the root of a gradient overflow with a finite loss."""
    first = state.tapes.first_bad(failure.step)
    if first is None:
        return False
    code: Code = "FORWARD_NAN" if first.nan else "FORWARD_OVERFLOW"
    state.ledger.add(Finding(code=code, severity="error", op=first.op, step=failure.step,
                             location=first.location, **hidden_code_text(first, label, failure.step)),
                     key=HIDDEN_LOSS_CODE)
    if failure.kind == "nonfinite_grads" and state.corrupted_by is None:
        state.corrupted_by = (code, HIDDEN_LOSS_CODE, failure.step)  # the unguarded step applied them
    return True


def arm_loss_trace(state: RunState, report: Callable[[LossSideTrace | None], None], *,
                   grads_at_scale: float | None = None) -> None:
    """Trace the next iteration from the end of a root forward (it records up to the loss's backward,
    and is closed at the end of the step); ``report`` gets the trace (its ``first`` op that made a
    finite value inf/NaN), or None when no iteration was traced.  ``grads_at_scale``: also follow the
    loss-side ops' backward (``script.lossgrad``), run at that loss scale."""
    if state.loss_trace_report is None:
        state.loss_trace_report = report
        state.loss_trace_scale = grads_at_scale


def open_loss_trace(state: RunState) -> None:
    """A root forward returned: open the armed trace (``arm_loss_trace``), if any."""
    if state.loss_trace_report is not None and state.loss_trace is None and not state.models.paused:
        scale = state.loss_trace_scale
        state.loss_trace = LossSideTrace(state.frames, lambda: state.models.paused,
                                         grads=None if scale is None else LossGrads(scale))
        state.loss_trace.__enter__()


def close_loss_trace(state: RunState, *, final: bool) -> None:
    """The step (``final``: the run) ended: hand this thread's trace to its report."""
    trace, report = state.loss_trace, state.loss_trace_report
    if trace is not None and report is not None and trace.thread == threading.get_ident():
        trace.__exit__(None, None, None)
        state.loss_trace = state.loss_trace_report = None
        report(trace)
    elif final and report is not None:
        state.loss_trace_report = None
        report(None)

