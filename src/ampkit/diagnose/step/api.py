"""``diagnose_step``: trace one step, compare it with FP32, find the culprit, verify the fix.

Algorithm (each run happens on a private deep copy, with the same RNG state):

1. **FP32 shadow** (``shadow=True``): the step on an fp32 copy with autocast disabled at its
   root; every module output and parameter gradient is kept as the reference.
2. **Traced low-precision run**: the step exactly as the caller runs it, under the op tracer
   (``ampkit.diagnose.step.trace``), comparing each module output with the reference on the fly.
3. **Findings**: an op that raised (DTYPE_MISMATCH / CAST_OVERFLOW); NaN in the data or
   non-finite parameters (NONFINITE_INPUT); the forward producer of the first non-finite value
   (FORWARD_OVERFLOW, FORWARD_NAN, CAST_OVERFLOW, NORM_STATS_NONFINITE), and past an overflow
   the op where the first NaN is born (its own FORWARD_NAN when the fp32 shadow has the same
   NaN, else named by the overflow); running statistics that became non-finite; else the
   backward producer (``ampkit.diagnose.step.backward``: BACKWARD_OVERFLOW), classified by
   re-running the backward at scale 1: an overflow that vanishes there is ordinary dynamic
   loss scaling (info), one that stays is an error (a derivative singularity when sqrt, acos
   ... was evaluated where its derivative is infinite); the loss dtype (LOSS_IN_LOW_PRECISION);
   for a finite step, PRECISION_LOSS and GRADIENT_UNDERFLOW from the shadow comparison.
4. **Bisection** (``bisect=True``) when a module kept in fp32 could fix the step
   (``ampkit.diagnose.step.bisect``), verified by a final run with the proposed ``keep_fp32``; a
   gradient PRECISION_LOSS's advice is tried before it is offered (``effect.checked_fixes``).

Cost: shadow + traced run ≈ 3–6 plain steps; a backward overflow at scale > 1 adds one traced
run; bisection adds one run per trial (bounded).  The user's model, its gradients and the
global RNG state are left exactly as they were.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ampkit.diagnose.capture import running_stats
from ampkit.diagnose.core.blockcast import quantized_layer_names
from ampkit.diagnose.core.display import display_location, display_module, preflight_hint_of, sort_findings
from ampkit.diagnose.core.stats import (
    FORMATS,
    finalize_ranges,
    headroom,
    merge_ranges,
    pending_range,
)
from ampkit.diagnose.step import compare
from ampkit.diagnose.step.backward import backward_finding
from ampkit.diagnose.step.effect import checked_fixes, effect_finding, fold_gradient_twin, spread_finding
from ampkit.diagnose.step.events import (
    Producer,
    error_finding,
    find_producer,
    input_findings,
    producer_finding,
)
from ampkit.diagnose.step.fp8 import fp8_candidates_only
from ampkit.diagnose.step.fp8ops import operand_pass
from ampkit.diagnose.step.programs import LossProgram, StepProgram
from ampkit.diagnose.step.result import DiagnosisResult, Headroom
from ampkit.diagnose.step.session import RunResult, Session
from ampkit.diagnose.step.trace import TraceLog
from ampkit.findings import Finding, loss_in_low_precision_finding
from ampkit.precision import Precision
from ampkit.thresholds import THRESHOLDS, RuleName, is_borderline

__all__ = ["diagnose_program", "diagnose_step"]

def diagnose_step(
    model: nn.Module,
    run: Callable[[nn.Module], torch.Tensor],
    *,
    precision: str | Precision,
    loss_scale: float | None = None,
    step: int | None = None,
    shadow: bool = True,
    bisect: bool = True,
    user_paths: Sequence[str] = (),
    sqnr_threshold_db: float | None = None,
    underflow_threshold: float = compare.UNDERFLOW_THRESHOLD,
) -> DiagnosisResult:
    """Diagnose one training step of ``model`` (see the module docstring).

    ``run(model)`` performs the forward and the loss under autocast, exactly like the training
    code, and returns the scalar loss; it is called several times, on copies of ``model``.
    ``loss_scale`` is the scale the training backward uses (None: no scaling).  ``sqnr_threshold_db``
    None: PRECISION_LOSS's threshold, or PRECISION_LOSS_FP8's for a model with fp8 layers.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> x = torch.randn(8, 4)
    >>> def run(m):
    ...     with torch.autocast("cpu", dtype=torch.bfloat16):
    ...         return m(x).float().pow(2).mean()
    >>> result = diagnose_step(model, run, precision="bf16")
    >>> [f.code for f in result.findings if f.severity == "error"]
    []
    >>> sorted(result.module_headroom["0"])
    ['bf16', 'fp16', 'fp8_e4m3', 'fp8_e5m2']
    """
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    prec = Precision.parse(precision, device) if not isinstance(precision, Precision) else precision
    program = LossProgram(run, loss_scale)
    return diagnose_program(model, program, prec, step=step, shadow=shadow, bisect=bisect, user_paths=user_paths,
                            sqnr_threshold_db=sqnr_threshold_db, underflow_threshold=underflow_threshold)


def diagnose_program(
    model: nn.Module, program: StepProgram, precision: Precision, *, step: int | None = None, shadow: bool = True,
    bisect: bool = True, user_paths: Sequence[str] = (), sqnr_threshold_db: float | None = None,
    underflow_threshold: float = compare.UNDERFLOW_THRESHOLD, session: Session | None = None,
) -> DiagnosisResult:
    """``diagnose_step`` for any step program (the replay passes an ``OutputGradProgram``)."""
    own = session is None
    sess = session or Session(model, program, precision, user_paths=tuple(user_paths))
    try:
        return _Diagnosis(sess, step=step, threshold_db=sqnr_threshold_db,
                          underflow_threshold=underflow_threshold).run(shadow=shadow, bisect=bisect)
    finally:
        if own:
            sess.close()


class _Diagnosis:
    def __init__(self, session: Session, *, step: int | None, threshold_db: float | None, underflow_threshold: float):
        self.s = session
        self.step = step
        rule: RuleName = "PRECISION_LOSS_FP8" if session.exclusion == "fp8_filter" else "PRECISION_LOSS"
        self.threshold_db = THRESHOLDS[rule].threshold if threshold_db is None else threshold_db
        self.underflow_threshold = underflow_threshold
        self.modules = dict(session.model.named_modules())
        self.findings: list[Finding] = []
        self.ref: RunResult | None = None
        self.ref_ranges: dict[str, tuple[float, float]] = {}
        self._broken_running: list[str] = []
        self._overflowed = False
        self._sqnr_targets: list[str] = []
        self._shadow_error: str | None = None

    # -- orchestration -------------------------------------------------------------------------
    def run(self, *, shadow: bool, bisect: bool) -> DiagnosisResult:
        s = self.s
        if shadow:
            self.ref = s.run(s.shadow_model(), mode="fp32", fp32=True, keep_outputs=True, trace=True)
            if self.ref.exception is not None:
                # The fp32 copy cannot run the step (explicit casts in user code): no shadow comparison.
                self._shadow_error = f"{type(self.ref.exception).__name__}: {self.ref.exception}"[:300]
                self.ref = None
        lp = s.run(s.work, mode="scaled", trace=True, stats=self.ref is None,
                   reference=self.ref.recorder.outputs if self.ref else None)
        self._broken_running = self._find_broken_running()
        s.reset_work()
        result = DiagnosisResult(findings=[], precision=s.precision.name, step=self.step, loss=lp.loss,
                                 loss_fp32=self.ref.loss if self.ref else None)
        if lp.exception is not None:
            self._exception_findings(lp)
        else:
            out_sqnr = compare.module_sqnr(lp.recorder.energies)
            fixable = self._step_findings(lp, out_sqnr)
            grads = None
            if self.ref is not None:
                grads = compare.compare_grads(
                    self.ref.grads, lp.grads, inv_scale=1.0 / s.program.loss_scale, param_module=s.param_module,
                    flushed_below=compare.flush_bound(s.precision.dtype, s.program.loss_scale))
                result.comparison = compare.summary(out_sqnr, grads)
                # Only "with no overflow involved": after an overflow every later difference is its echo.
                if lp.finite and not self._overflowed:
                    prec = compare.precision_findings(
                        order=lp.recorder.order, out_sqnr=out_sqnr, grads=grads, threshold_db=self.threshold_db,
                        underflow_threshold=self.underflow_threshold, precision=s.precision.name,
                        loss_scale=s.program.loss_scale, step=self.step,
                        fp8_layers=quantized_layer_names(s.work) if s.exclusion == "fp8_filter" else None)
                    self.findings.extend(prec)
                    # A borderline row asks for no change, so it starts no keep-fp32 search.
                    fixable.extend(f for f in prec if f.code == "PRECISION_LOSS" and f.evidence["kind"] == "activation"
                                   and not is_borderline(f))
            if s.exclusion == "fp8_filter":
                result.comparison["fp8_operands"], flush = operand_pass(s, self.step)
                self.findings.extend(flush)
                fixable.extend(f for f in flush if not is_borderline(f))
            if bisect and fixable:
                self._bisect(result, lp, fixable, out_sqnr)
            self.findings = checked_fixes(self.findings, s, self.ref, threshold_db=self.threshold_db, verify=bisect,
                                          bisection=result.bisection)
        if self._shadow_error is not None:
            result.comparison["shadow_unavailable"] = self._shadow_error
        result.module_headroom, result.grad_headroom = self._headroom(lp)
        result.findings = sort_findings(self.findings)
        return result

    # -- findings --------------------------------------------------------------------------------
    def _exception_findings(self, lp: RunResult) -> None:
        assert lp.exception is not None
        err = lp.log.error if lp.log is not None else None
        finding = error_finding(err, lp.exception, step=self.step) if err is not None else None
        if finding is None:
            raise lp.exception
        self.findings.append(finding)

    def _step_findings(self, lp: RunResult, out_sqnr: dict[str, float]) -> list[Finding]:
        """Findings of the traced run; returns those a module kept in fp32 could fix."""
        assert lp.log is not None
        s, log = self.s, lp.log
        fixable: list[Finding] = []
        if lp.loss_dtype in ("fp16", "bf16"):
            self.findings.append(loss_in_low_precision_finding(
                lp.loss_dtype, scale=s.program.loss_scale, location=display_location(lp.loss_location), step=self.step))
        inputs = input_findings(log, step=self.step)
        self.findings.extend(inputs)
        nonfinite = not lp.finite
        fwd = find_producer(log, "forward")
        if fwd is not None:
            fixable.extend(self._forward_findings(log, fwd, out_sqnr, nonfinite))
        self.findings.extend(self._running_stats(fwd))
        if fwd is None and not inputs and lp.loss_finite and not lp.grads_finite:
            bwd = find_producer(log, "backward")
            if bwd is not None:
                self._overflowed = True
                f = backward_finding(s, lp, bwd, step=self.step, ref=self.ref)
                self.findings.append(f)
                if f.severity == "error":
                    fixable.append(f)
        if nonfinite and not self._overflowed and not any(f.severity == "error" for f in self.findings):
            self.findings.append(Finding(
                code="FORWARD_NAN" if not lp.loss_finite else "BACKWARD_OVERFLOW", severity="error",
                message=("the step is non-finite but no traced op produced the first non-finite value (it came "
                         "from code the tracer does not see: a custom kernel or an op outside the step function)"),
                fix="Run the step with torch.autograd.set_detect_anomaly(True) to locate the untraced op.",
                step=self.step, evidence={"loss_finite": lp.loss_finite, "nonfinite_grads": lp.nonfinite_grads[:20]},
            ))
        return fixable

    def _forward_findings(self, log: TraceLog, fwd: Producer, out_sqnr: dict[str, float],
                          nonfinite: bool) -> list[Finding]:
        """The finding of the forward producer (and of a later NaN birth); returns the fixable ones."""
        self._overflowed = True
        module = fwd.record.module
        corrupted = out_sqnr.get(module or "\0", math.nan) if not nonfinite else math.nan
        fp32_nan = self._nan_in_fp32(fwd) if fwd.kind != "overflow" else None
        f = producer_finding(fwd, step_nonfinite=nonfinite, step=self.step, module_type=self._module_type(module),
                             reference_absmax=self._ref_absmax(module), log=log, fp32_nan=fp32_nan)
        if not math.isnan(corrupted) and corrupted < self.threshold_db:
            # Absorbed downstream (rsqrt(inf) = 0, softmax of inf ...): finite, but wrong.
            f = dataclasses.replace(
                f, severity="error",
                message=f.message.replace(" The step still ended finite (the value was masked or saturated "
                                          "later).", "")
                + f" The step ended finite but silently wrong: {display_module(module)}'s output is "
                  f"{corrupted:.1f} dB SQNR from fp32.",
                evidence={**f.evidence, "module_output_sqnr_db": corrupted})
            self._sqnr_targets.append(module or "")
        births: list[Finding] = []
        if fwd.kind == "overflow":
            f, births = self._nan_birth(log, f, nonfinite)
        self.findings.append(f)
        self.findings.extend(births)
        return [f] if f.severity == "error" and not fp32_nan else []

    def _nan_birth(self, log: TraceLog, overflow: Finding, nonfinite: bool) -> tuple[Finding, list[Finding]]:
        """Where the first NaN is born when an earlier op only overflowed.

        A NaN that the fp32 reference produces at the same op is a bug of its own (no module kept in
        fp32 removes it, e.g. a softmax over a row of summed −inf masks): FORWARD_NAN there, naming
        the inf that fed it.  A NaN the reference does not produce is the overflow's echo (an inf
        normalised by a softmax or a norm), removed by the overflow's fix: the overflow names it.
        """
        birth = find_producer(log, "forward", nan_only=True)
        if birth is None:
            return overflow, []
        module = birth.record.module
        if self._nan_in_fp32(birth):
            return overflow, [producer_finding(
                birth, step_nonfinite=nonfinite, step=self.step, module_type=self._module_type(module),
                reference_absmax=self._ref_absmax(module), log=log, fp32_nan=True, nan_birth=True)]
        rec = birth.record
        loc = display_location(rec.location)
        note = f" Its inf turns into NaN at {rec.op} in {display_module(module)}" + (f" ({loc})." if loc else ".")
        return dataclasses.replace(overflow, message=overflow.message + note, evidence={
            **overflow.evidence, "nan_birth": {"op": rec.op, "module": module, "location": loc, "op_index": rec.index},
        }), []

    def _nan_in_fp32(self, birth: Producer) -> bool | None:
        """Whether the fp32 shadow's first NaN is born at the same op and line (None: no shadow)."""
        if self.ref is None or self.ref.log is None:
            return None
        ref = find_producer(self.ref.log, "forward", nan_only=True)
        return ref is not None and (ref.record.op, ref.record.module, ref.record.location) == (
            birth.record.op, birth.record.module, birth.record.location)

    def _running_stats(self, fwd: Producer | None) -> list[Finding]:
        """NORM_STATS_NONFINITE for running statistics this step turned non-finite."""
        broken = self._broken_running
        if not broken:
            return []
        owners = sorted({n.rpartition(".")[0] for n in broken})
        if fwd is not None and fwd.record.module in owners and "norm" in fwd.record.op.split("::")[-1]:
            return []  # the producer finding already is NORM_STATS_NONFINITE for this layer
        cause = (f" because {fwd.record.op} in {display_module(fwd.record.module)} produced a non-finite value "
                 "upstream" if fwd is not None else "")
        return [Finding(
            code="NORM_STATS_NONFINITE", severity="error",
            message=(f"running statistics {broken[:6]} became non-finite during this step{cause}; they persist "
                     "across steps and poison every later evaluation (model.eval()) even after training recovers"),
            fix=("Keep the normalisation layer(s) in fp32 (MixedPrecision(..., keep_fp32=[" + ", ".join(
                repr(o) for o in owners[:4]) + "])) and fix the upstream overflow; reset the statistics "
                 "(module.reset_running_stats()) or restore them from a checkpoint."),
            module=owners[0], step=self.step, evidence={"buffers": broken[:20]},
        )]

    def _find_broken_running(self) -> list[str]:
        """Running-statistics buffers (``diagnose.capture.running_stats``) finite before the traced run and
        non-finite after it."""
        before, names = self.s.buffers_before, {id(b): n for n, b in self.s.work.named_buffers()}
        items = [(names[id(b)], b) for _, bufs in running_stats(self.s.work) for b in bufs]
        if not items:
            return []
        after = torch.stack([torch.isfinite(b).all() for _, b in items]).tolist()
        pre = torch.stack([torch.isfinite(before[n]).all() for n, _ in items]).tolist()
        return [n for (n, _), a, p in zip(items, after, pre) if p and not a]

    def _module_type(self, name: str | None) -> str | None:
        return type(self.modules[name]).__name__ if name is not None and name in self.modules else None

    def _ref_absmax(self, name: str | None) -> float | None:
        if self.ref is None:
            return None
        if not self.ref_ranges:
            names = [n for n, v in self.ref.recorder.out_ranges.items() if v]
            merged = [merge_ranges(self.ref.recorder.out_ranges[n]) for n in names]
            self.ref_ranges = dict(zip(names, finalize_ranges(merged)))
        rng = self.ref_ranges.get(name if name is not None else "\0")
        return rng[0] if rng is not None else None

    # -- bisection -------------------------------------------------------------------------------
    def _bisect(self, result: DiagnosisResult, lp: RunResult, fixable: list[Finding],
                out_sqnr: dict[str, float]) -> None:
        from ampkit.diagnose.step.bisect import (
            EFFECT_SCAN_LIMIT,
            Objective,
            bisect_keep_fp32,
            effect_candidates,
            rank_candidates,
        )

        sqnr_modules = [f.module for f in fixable if f.code == "PRECISION_LOSS" and f.module is not None]
        sqnr_modules += [m for m in self._sqnr_targets if m not in sqnr_modules]
        objective = Objective(need_finite=self._overflowed, sqnr_modules=sqnr_modules, threshold_db=self.threshold_db,
                              reference=self.ref.recorder.outputs if self.ref else None)
        candidates = rank_candidates([f.module for f in fixable], out_sqnr, order=lp.recorder.order,
                                     threshold_db=self.threshold_db)
        # Precision loss is judged by its effect on the output: every candidate kept in fp32 alone first.
        loss = next((f for f in fixable if f.code == "PRECISION_LOSS" and f.evidence["kind"] == "activation"), None)
        scan = (effect_candidates(lp.recorder.order, out_sqnr, threshold_db=self.threshold_db)
                if loss is not None and objective.reference is not None and not self._overflowed else None)
        if self.s.exclusion == "fp8_filter":
            candidates, scan = fp8_candidates_only(self.s.work, lp.recorder.order, candidates, scan, EFFECT_SCAN_LIMIT)
        outcome = bisect_keep_fp32(self.s, objective, candidates, reference_run=self.ref, scan=scan, baseline=out_sqnr)
        result.bisection = outcome.to_json()
        if loss is not None and outcome.spread_gain_db is not None:
            self.findings = [spread_finding(f, outcome, exclusion=self.s.exclusion) if f is loss else f
                             for f in self.findings]
        if loss is not None and outcome.culprit is not None:
            named = effect_finding(loss, outcome, out_sqnr, exclusion=self.s.exclusion)
            self.findings = fold_gradient_twin([named if f is loss else f for f in self.findings], named)
            fixable = [f for f in self.findings if f.code == "PRECISION_LOSS" and f.module == named.module] + [
                f for f in fixable if f is not loss]
        if outcome.keep_fp32 is None:
            return
        how = self.s.exclusion
        if how == "keep_fp32":
            result.keep_fp32 = outcome.keep_fp32
        else:
            result.fp8_filter = outcome.keep_fp32
        verified = outcome.verification or {}
        outcomes = []
        if verified.get("loss") is not None:  # replays that start from the output gradient have no loss
            fp32 = f" (fp32: {result.loss_fp32})" if result.loss_fp32 is not None else ""
            outcomes.append(f"loss {verified['loss']}{fp32}")
        if isinstance(verified.get("output_sqnr_db"), float):
            before = out_sqnr.get("")
            was = f" (was {before:.1f} dB)" if how == "fp8_filter" and before is not None else ""
            outcomes.append(f"output SQNR {verified['output_sqnr_db']:.1f} dB{was}")
        outcomes.append("finite gradients")
        text = (f"Verified fix: MixedPrecision(..., {how}={outcome.keep_fp32!r}) — re-running this step with "
                f"it gives {', '.join(outcomes[:-1])}{' and ' if len(outcomes) > 1 else ''}{outcomes[-1]}.")
        ids = {id(f) for f in fixable if f.code != "FP8_FLUSH" or f.module in outcome.keep_fp32}
        self.findings = [dataclasses.replace(f, fix=f"{text}{_alternative(f.fix)}{preflight_hint_of(f.fix)}",
                                             evidence={**f.evidence, "verified_fix": verified})
                         if id(f) in ids else f for f in self.findings]

    # -- headroom --------------------------------------------------------------------------------
    def _headroom(self, lp: RunResult) -> tuple[Headroom, Headroom]:
        src = self.ref if self.ref is not None else lp
        names = [n for n, v in src.recorder.out_ranges.items() if v]
        ranges = [merge_ranges(src.recorder.out_ranges[n]) for n in names]
        inv = 1.0 if self.ref is not None else 1.0 / self.s.program.loss_scale
        by_module: dict[str, list[torch.Tensor]] = {}
        for pname, g in src.grads.items():
            by_module.setdefault(self.s.param_module.get(pname, ""), []).append(g)
        gnames = list(by_module)
        granges = [merge_ranges([pending_range(g) for g in by_module[m]]) for m in gnames]
        values = finalize_ranges(ranges + granges)
        out_min = {n: v[1] for n, v in zip(names, values[: len(names)])}
        grad_min = {m: v[1] * inv for m, v in zip(gnames, values[len(names):])}
        fwd_peak = self._peaks(src, "forward", 1.0, {n: v[0] for n, v in zip(names, values[: len(names)])})
        bwd_peak = self._peaks(src, "backward", inv, {m: v[0] * inv for m, v in zip(gnames, values[len(names):])})

        def rooms(peaks: dict[str, float], mins: dict[str, float]) -> Headroom:
            order = list(dict.fromkeys([*mins, *peaks]))
            return {n: {k: (headroom(peaks.get(n, 0.0), math.inf, fmt)[0],
                            headroom(0.0, mins.get(n, math.inf), fmt)[1]) for k, fmt in FORMATS.items()}
                    for n in order}

        return rooms(fwd_peak, out_min), rooms(bwd_peak, grad_min)

    def _peaks(self, run: RunResult, phase: str, scale: float, base: dict[str, float]) -> dict[str, float]:
        """Largest finite magnitude per module over the traced ops of ``phase`` (ancestors included)."""
        peaks = dict(base)
        if run.log is None:
            return peaks
        known = self.modules
        for rec in run.log.records:
            if rec.phase != phase or rec.module is None or not rec.out_slots:
                continue
            v = max((run.log.absmax(sl) for sl in rec.out_slots), default=0.0) * scale
            if not math.isfinite(v):
                continue
            name = rec.module
            while True:
                if name in known and v > peaks.get(name, 0.0):
                    peaks[name] = v
                if name == "":
                    break
                name = name.rpartition(".")[0]
        return peaks


def _alternative(fix: str) -> str:
    """The part of a finding's fix after its generic keep-fp32 advice (replaced by the verified one), without the
    preflight hint (added back after it)."""
    marker = "in a hand-written loop). "
    rest = fix.split(marker, 1)[1] if marker in fix else ""
    rest = rest[: len(rest) - len(preflight_hint_of(rest))]
    return " " + rest if rest else ""
