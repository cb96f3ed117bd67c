"""End-of-run rules over what the watchers saw: SCALE_COLLAPSE (with its cause),
SCHEDULER_STEPPED_ON_SKIP, AUTOCAST_INACTIVE, MIXED_PRECISION_OFF (``script.mixed``),
SCALER_WITH_BF16, NORM_STATS_NONFINITE and SLOW_LOW_PRECISION (measured on this machine by
``ampkit.diagnose.core.perf``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.perf import fp8_gemm_speed, low_precision_speed
from ampkit.diagnose.script import failures
from ampkit.diagnose.script.losstrace import HIDDEN_LOSS_CODE
from ampkit.diagnose.script.mixed import report_mixed_precision_off, scaler_off_too
from ampkit.findings import BF16_NEEDS_NO_SCALER, Finding, scale_collapse, scheduler_stepped_on_skip
from ampkit.fp8 import fp8_layer_names
from ampkit.precision import LOW_PRECISION_DTYPES
from ampkit.thresholds import THRESHOLDS, Outcome, as_borderline

if TYPE_CHECKING:
    from ampkit.diagnose.script.context import Context
    from ampkit.diagnose.script.services.scalers import ScalerInfo
    from ampkit.diagnose.script.state import SkipCause

__all__ = ["COLLAPSE_STEADY_FRACTION", "finalize", "slow_low_precision"]
COLLAPSE_STEADY_FRACTION = THRESHOLDS["SCALE_COLLAPSE"].threshold
"""A scale that still skips this fraction of the second half of a run never settled (beyond the
borderline band of ``ampkit.thresholds``; inside it the finding is a borderline info row)."""

def finalize(ctx: Context, *, intended: str | None = None, measure_speed: bool = True,
             flags: Mapping[str, str] | None = None) -> None:
    """Evaluate the end-of-run rules into ``ctx.state.ledger`` (flushes pending reads first); ``flags``:
    the script's settings that ask for low precision (``script.mixed.requested_flags``)."""
    failures.check_norm_stats(ctx.state)
    ctx.state.pending.flush()
    _scale_collapse(ctx)
    _boundary_overflow(ctx)
    _scheduler_on_skip(ctx)
    _autocast_inactive(ctx, intended)
    report_mixed_precision_off(ctx, flags or {})
    _scaler_with_bf16(ctx)
    _norm_stats(ctx)
    if measure_speed:
        _slow_low_precision(ctx)
    ctx.finish()


def _collapsed(info: ScalerInfo, skips: Mapping[int, str], iterations: int) -> tuple[Outcome, str, float | None]:
    """(outcome, why, the late skip share when that decided) for one scaler."""
    scales = [s for _, s in info.scales]
    if scales and min(scales) < 1.0:
        return "reported", f"the scale fell to {min(scales):g} (below 1: even unscaled gradients are non-finite)", None
    if iterations >= 16:
        half = range(iterations // 2 + 1, iterations + 1)  # skips are keyed by step, counted from 1
        late = sum(1 for it in half if it in skips)
        share = late / len(half)
        outcome = THRESHOLDS["SCALE_COLLAPSE"].judge(share) if late >= 8 else "clear"
        if outcome != "clear":
            return outcome, f"{late} of the last {len(half)} steps were still skipped (the scale never settles)", share
    return "clear", "", None


def _scale_collapse(ctx: Context) -> None:
    if not ctx.state.skips:
        return
    rule = THRESHOLDS["SCALE_COLLAPSE"]
    for info in ctx.state.scalers.enabled_infos():
        outcome, why, share = _collapsed(info, ctx.state.skips, ctx.state.steps)
        if outcome == "clear":
            continue
        causes: dict[SkipCause, int] = {}
        for cause in ctx.state.skips.values():
            cause = ctx.state.cause_of.get(cause, cause)
            causes[cause] = causes.get(cause, 0) + 1
        cause = max(causes, key=lambda c: causes[c])
        message, fix = scale_collapse(
            cause, f"the {info.label} (created at {info.location}) skipped {len(ctx.state.skips)} of {ctx.state.steps} "
            f"steps: {why}", f" ({causes[cause]} of the skipped steps)")
        scales = [s for _, s in info.scales]
        evidence = {
            "cause": cause, "causes": causes, "skipped_steps": len(ctx.state.skips), "steps": ctx.state.steps,
            "init_scale": info.init_scale, "min_scale": min(scales) if scales else None,
            "final_scale": scales[-1] if scales else None, "first_skips": sorted(ctx.state.skips)[:16],
        }
        finding = Finding(code="SCALE_COLLAPSE", severity="error", message=message, fix=fix,
                          location=info.location, step=min(ctx.state.skips),
                          evidence=evidence if share is None else {**evidence, "judgement": rule.evidence(share)})
        if outcome == "borderline" and share is not None:
            finding = as_borderline(finding, rule, share)
        ctx.state.ledger.add(finding, key=info.location)


def _boundary_overflow(ctx: Context) -> None:
    """Skipped steps whose gradient was already non-finite where it entered a model's output."""
    hits = ctx.state.boundary_overflows
    if not hits or ctx.state.ledger.has("BACKWARD_OVERFLOW", key="loss-code-backward") or any(
            ctx.state.ledger.has(code, key=HIDDEN_LOSS_CODE) for code in ("FORWARD_OVERFLOW", "FORWARD_NAN")):
        return  # the loss-side backward trace named the op (``script.lossgrad``), or its tape the forward op
        # whose hidden inf/NaN the backward met (``script.losstrace``)
    # Recovered: some step after the first hit was applied.  Without that (every later step skipped, a
    # run too short for SCALE_COLLAPSE's window) the overflow cannot be called ordinary.
    recovered = any(step not in ctx.state.skips for step in range(hits[0] + 1, ctx.state.steps + 1))
    collapsed = ctx.state.ledger.has("SCALE_COLLAPSE", acting=True) or not recovered
    label = ctx.state.locations.get("boundary_model")
    ctx.state.ledger.add(Finding(
        code="BACKWARD_OVERFLOW", severity="error" if collapsed else "info",
        message=(f"on {len(hits)} skipped step(s) (first: {hits[0]}) the gradient was already inf/NaN where it "
                 f"reached the output of {label}: the overflow happened in the code between the model and the loss "
                 "(ops outside any module that ran in low precision), not inside the model"
                 + ("; it persisted while the scale collapsed, so it overflows at any scale" if collapsed else
                    "; the scaler recovered, so this was ordinary dynamic loss scaling")),
        fix=("compute what follows the model in fp32: call .float() on the model output before the loss and any "
             "normalisation/temperature scaling" if collapsed else
             "nothing to change if it happens only while the scale settles"),
        location=ctx.state.locations.get("boundary_overflow"), step=hits[0], evidence={"steps": hits[:32]},
    ), key="boundary")


def _scheduler_on_skip(ctx: Context) -> None:
    hits = ctx.optim.sched_on_skip
    if not hits or ctx.optim.scheduler_steps < 0.5 * max(1, ctx.state.steps):
        return  # an epoch-level scheduler after a skipped last step is not worth a warning
    location = ctx.state.locations.get("scheduler_step")
    message, fix = scheduler_stepped_on_skip(len(hits), hits[0])
    ctx.state.ledger.add(Finding(
        code="SCHEDULER_STEPPED_ON_SKIP", severity="warning", message=message, fix=fix,
        location=location, step=hits[0], evidence={"skipped_scheduler_steps": len(hits), "steps": hits[:32]},
    ), key=location)


def _autocast_inactive(ctx: Context, intended: str | None) -> None:
    f = ctx.state.forwards
    for req in ctx.autocast.requests.values():
        if req.requested and not req.effective:
            why = ("CUDA is not available on this machine" if req.device_type == "cuda"
                   else f"{dtype_name(req.dtype)} is not an autocast dtype for {req.device_type}")
            ctx.state.ledger.add(Finding(
                code="AUTOCAST_INACTIVE", severity="warning",
                message=(f"torch.autocast(device_type={req.device_type!r}, dtype={dtype_name(req.dtype)}) at "
                         f"{req.location} was disabled by torch because {why}: the forward ran in fp32"
                         + (scaler_off_too(ctx) if req.device_type == "cuda" else "")),
                fix=("build autocast for the device the model runs on: `torch.autocast(device_type=x.device.type, "
                     "dtype=torch.bfloat16)` (on CPU prefer bf16)"),
                location=req.location, evidence={"device_type": req.device_type, "dtype": dtype_name(req.dtype)},
            ), key=("disabled", req.location))
    for (other, dev), n in f.wrong_device.items():
        loc = next((r.location for r in ctx.autocast.requests.values() if r.device_type == other and r.effective),
                   None)
        ctx.state.ledger.add(Finding(
            code="AUTOCAST_INACTIVE", severity="warning",
            message=(f"autocast was enabled for device_type={other!r} but the model runs on {dev!r}: autocast "
                     f"only casts ops of its own device type, so {n} forward(s) ran in fp32"),
            fix=f"use `torch.autocast(device_type={dev!r}, ...)` (or derive it from the model: "
                "`next(model.parameters()).device.type`)",
            location=loc, evidence={"autocast_device_type": other, "model_device_type": dev, "forwards": n},
        ), key=("device", other, dev))
    for thread, (n, other, where, line) in f.outside_threads.items():
        if thread in f.autocast_threads:
            continue  # this thread enters autocast itself; these were its fp32 forwards (evaluation, ...)
        ctx.state.ledger.add(Finding(
            code="AUTOCAST_INACTIVE", severity="warning",
            message=(f"{n} forward(s) ran in thread {thread!r} in fp32 while thread {other!r} was inside "
                     f"torch.autocast (entered at {where}): autocast is thread-local, so work handed to "
                     "another thread (a thread pool, a prefetching or teacher thread) does not inherit it"),
            fix=("enter autocast inside the function the thread runs (`with torch.autocast(device_type=..., "
                 "dtype=...):` around its forward), or decorate that function with "
                 "`@torch.autocast(device_type=..., dtype=...)`"),
            location=line, evidence={"thread": thread, "autocast_thread": other, "forwards": n},
        ), key=("thread", thread))
    used_autocast = sum(f.autocast.values()) > 0 or sum(f.half_params.values()) > 0
    scalers = [info for info in ctx.state.scalers.enabled_infos() if info.used]
    if scalers and f.total and not used_autocast and not ctx.state.ledger.has("AUTOCAST_INACTIVE"):
        info = scalers[0]
        ctx.state.ledger.add(Finding(
            code="AUTOCAST_INACTIVE", severity="warning",
            message=(f"a GradScaler (created at {info.location}) scales the loss, but none of the {f.total} "
                     "forward passes ran under autocast: the model trains in fp32 and pays for loss scaling "
                     "for nothing"),
            fix="wrap the forward and the loss in `with torch.autocast(device_type=..., dtype=torch.float16):` "
                "(check its `enabled=` argument), or drop the GradScaler for fp32 training",
            location=info.location, evidence={"forwards": f.total},
        ), key="scaler_without_autocast")
    if intended and f.total and not used_autocast and not ctx.state.ledger.has("AUTOCAST_INACTIVE"):
        ctx.state.ledger.add(Finding(
            code="AUTOCAST_INACTIVE", severity="info",
            message=(f"--precision {intended} was asked for, but no forward of the script ran under autocast "
                     "(it trains in fp32); the op-level findings show what that precision would do"),
            fix=f"wrap the forward and the loss in torch.autocast with the {intended} dtype to train in it",
        ), key="intended")


def _scaler_with_bf16(ctx: Context) -> None:
    for info in ctx.state.scalers.enabled_infos():
        if info.saw_bf16 and not info.saw_fp16:
            ctx.state.ledger.add(Finding(
                code="SCALER_WITH_BF16", severity="warning",
                message=(f"a GradScaler (created at {info.location}) scales a loss computed under bf16 autocast: "
                         f"{BF16_NEEDS_NO_SCALER}"),
                fix="drop the GradScaler for bf16 (`loss.backward(); optimizer.step()`), or pass "
                    "`enabled=(dtype == torch.float16)`",
                location=info.location,
            ), key=info.location)


def _norm_stats(ctx: Context) -> None:
    for name, (it, count, after_skip) in ctx.state.norm_bad.items():
        ctx.state.ledger.add(Finding(
            code="NORM_STATS_NONFINITE", severity="error", module=name,
            message=(f"the running statistics of {name} hold {count} non-finite values (first seen at step {it}"
                     f"{', right after a skipped step' if after_skip else ''}): every eval-mode forward through "
                     "it now returns NaN. A skipped optimizer step does not undo the running-stat update of its "
                     "forward, so one overflowing batch corrupts them for good"),
            fix=(f"keep {name} (and the op feeding it) in fp32, normalise the inputs, and repair the stats: "
                 f"`model.{name}.reset_running_stats()` then a few train-mode forwards on clean batches"),
            step=it, evidence={"nonfinite": count, "after_skipped_step": after_skip},
        ), key=name)


@functools.cache
def slow_low_precision(name: str, device: str) -> Finding | None:
    """SLOW_LOW_PRECISION for ``name`` on ``device``, measured once per process (about 1 s on a CPU
    without fp16 units; 512x512 matmuls: small ones are dominated by overheads)."""
    return low_precision_speed(name, device, n=512, rounds=3)


@functools.cache
def slow_fp8_gemm(device: str) -> Finding | None:
    """SLOW_FP8_GEMM on ``device``, measured once per process (about 1 s on a CPU)."""
    return fp8_gemm_speed("fp8", device)


def _slow_low_precision(ctx: Context) -> None:
    last = ctx.state.models.last
    if last is not None and fp8_layer_names(last.root):  # fp8 layers: their GEMMs are timed against bf16
        finding = slow_fp8_gemm(str(last.device))
        if finding is not None:
            ctx.state.ledger.add(finding, key=(str(last.device), "fp8"))
    f = ctx.state.forwards
    used = {d for d, n in (f.autocast + f.half_params).items() if n and d in LOW_PRECISION_DTYPES}
    for device in sorted(f.devices):
        for dtype in sorted(used, key=str):
            finding = slow_low_precision(dtype_name(dtype), device)
            if finding is not None:
                ctx.state.ledger.add(finding, key=(device, dtype))
