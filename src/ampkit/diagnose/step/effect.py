"""PRECISION_LOSS judged by its effect on the model's output.

A module's own SQNR says where a precision loss *shows*, not where it is *made*: a timestep
projection or a coordinate embedding with a large offset rounds its bf16 output to a few
significant bits and still sits at 40-50 dB itself (the rounding error is small next to the
large values), while the module after it, which subtracts, normalises or takes a sine, falls
to 0 dB.  The effect scan of ``ampkit.diagnose.step.bisect`` keeps each candidate in fp32 alone
and measures the model output against the fp32 shadow; ``effect_finding`` restates the
activation PRECISION_LOSS finding at the module whose fp32 keeping restores the output, with
the output's SQNR before and after as evidence.  The module that first fell below the
threshold stays in the evidence (``first_below_threshold``).

Every PRECISION_LOSS fix says whether it was verified (``checked_fixes``): the evidence carries
``fix_verified`` and, for a fix that was tried, ``fix_sqnr_db`` (the SQNR it reached) and
``fix_tried``.  A gradient PRECISION_LOSS's keep-fp32 advice is tried before it is offered: the
module, then its enclosing block, each on a fresh copy, the whole step re-run; one that leaves the
gradient below the threshold is not offered, the fix says what was tried and what to do instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ampkit.diagnose.core.display import display_module, fp8_filter_fix, keep_fp32_fix, preflight_hint_of
from ampkit.diagnose.step.bisect import BisectOutcome, kept_phrase, verify_keep_fp32
from ampkit.diagnose.step.session import RunResult, Session
from ampkit.findings import Finding
from ampkit.thresholds import is_borderline

__all__ = ["checked_fixes", "effect_finding", "fold_gradient_twin", "refused_fix", "spread_finding"]


def _db(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f} dB"


def effect_finding(finding: Finding, outcome: BisectOutcome, out_sqnr: dict[str, float], *,
                   exclusion: str = "keep_fp32") -> Finding:
    """``finding`` (activation PRECISION_LOSS) named at the effect scan's culprit, when it has one.

    ``exclusion``: what the scan did to each candidate, ``keep_fp32`` or ``fp8_filter`` (kept out of fp8).

    >>> from ampkit.diagnose.step.bisect import Trial
    >>> f = Finding(code="PRECISION_LOSS", severity="warning", message="m", fix="f", module="norm",
    ...             evidence={"kind": "activation", "sqnr_db": 0.0, "threshold_db": 20.0})
    >>> trial = Trial(keep=["proj"], fixed=True, finite=True, sqnr_db={"norm": 45.0, "": 48.0})
    >>> outcome = BisectOutcome(["proj"], [trial], None, "verified", {"proj": trial}, "proj")
    >>> g = effect_finding(f, outcome, {"proj": 47.0, "norm": 0.0, "": 1.5})
    >>> g.module, g.evidence["output_sqnr_db_before"], g.evidence["output_sqnr_db_after"]
    ('proj', 1.5, 48.0)
    >>> g.evidence["first_below_threshold"]
    'norm'
    """
    culprit = outcome.culprit
    if culprit is None or culprit not in outcome.effects:
        return finding
    trial = outcome.effects[culprit]
    before, after = out_sqnr.get(""), trial.sqnr_db.get("")
    own = out_sqnr.get(culprit)
    first = finding.module
    threshold = finding.evidence.get("threshold_db")
    shows = (f"; its own output is {_db(own)} from fp32, so the loss first shows in {display_module(first)}'s output "
             f"({_db(finding.evidence.get('sqnr_db'))})" if first != culprit else
             f"; its own output is {_db(own)} from fp32")
    kept = kept_phrase(exclusion)
    message = (f"{display_module(culprit)} loses the signal in {finding.evidence.get('precision', 'low precision')} "
               f"with no overflow: {kept} alone, it brings the model output from {_db(before)} to {_db(after)} "
               f"SQNR against fp32 (threshold {threshold:g} dB){shows}" if isinstance(threshold, float) else
               f"{display_module(culprit)} loses the signal with no overflow{shows}")
    fix = fp8_filter_fix([culprit]) if exclusion == "fp8_filter" else keep_fp32_fix(
        culprit, "Or compute its sensitive part in fp32 (products of large values such as timesteps times "
                 "frequencies, sums over long ranges, E[x^2] - E[x]^2), or remove the large offset from its input "
                 "(center coordinates, normalise time).")
    evidence = {
        **finding.evidence, "judged_by": "output_effect", "first_below_threshold": first, "module_sqnr_db": own,
        "output_sqnr_db_before": before, "output_sqnr_db_after": after,
        "effects": _output_effects(outcome),
    }
    return dataclasses.replace(finding, module=culprit, message=message, fix=fix, evidence=evidence)


def _output_effects(outcome: BisectOutcome) -> dict[str, float | None]:
    """The model output's SQNR with each scanned module excluded alone (the evidence's ``effects``)."""
    return {m: t.sqnr_db.get("") for m, t in outcome.effects.items()}


def spread_finding(finding: Finding, outcome: BisectOutcome, *, exclusion: str = "keep_fp32") -> Finding:
    """``finding`` (activation PRECISION_LOSS) when the keep-fp32 search found the loss spread over the model.

    Its generic advice (keep the module in fp32, or out of fp8) was just tried and does not help,
    so the fix says what was measured and what does.  ``exclusion`` as for ``effect_finding``.

    >>> from ampkit.diagnose.step.bisect import Trial
    >>> f = Finding(code="PRECISION_LOSS", severity="warning", message="m", fix="Keep 'a' in fp32", module="a",
    ...             evidence={"kind": "activation", "sqnr_db": 18.0, "threshold_db": 20.0})
    >>> trial = Trial(keep=["a", "b"], fixed=False, finite=True, sqnr_db={"": 17.9})
    >>> g = spread_finding(f, BisectOutcome(None, [trial], None, "spread", {}, None, 0.01, 2))
    >>> g.evidence["judged_by"], g.evidence["together_gain_db"]
    ('spread', 0.01)
    >>> spread_finding(f, BisectOutcome(None, [trial], None, "spread", {}, None, 0.01, 2),
    ...                exclusion="fp8_filter").fix.split(", moved")[0]
    'No small fp8_filter list restores it: the 2 modules tried, kept out of fp8 all together'
    """
    if outcome.spread_gain_db is None:
        return finding
    instead = ("train this model in fp32 rather than with a keep_fp32 list" if exclusion == "keep_fp32" else
               "leave this model's layers out of fp8 (bf16 autocast) rather than with an fp8_filter list")
    fix = (f"No small {exclusion} list restores it: the {outcome.spread_modules} modules tried, "
           f"{kept_phrase(exclusion)} all together, moved the model output by {outcome.spread_gain_db:+.2f} dB, "
           "so the error is rounding that accumulates through many layers, not one module's.  Confirm that it "
           f"matters with `ampkit verify` against fp32; if it does, {instead}.")
    evidence = {**finding.evidence, "judged_by": "spread", "together_gain_db": outcome.spread_gain_db,
                "tried_together": outcome.spread_modules}
    if outcome.effects:
        evidence["effects"] = _output_effects(outcome)
    return dataclasses.replace(finding, fix=fix, evidence=evidence)


def fold_gradient_twin(findings: list[Finding], named: Finding) -> list[Finding]:
    """``findings`` with the gradient PRECISION_LOSS of ``named``'s module folded into ``named``.

    Both then say the same thing about one module; the reports keep one finding per code and
    module, so the gradient's SQNR moves into the evidence instead of replacing the message.
    """
    twin = next((f for f in findings if f.code == "PRECISION_LOSS" and f.module == named.module
                 and f.evidence.get("kind") == "gradient"), None)
    if twin is None:
        return findings
    folded = dataclasses.replace(named, evidence={
        **named.evidence, "gradient_sqnr_db": twin.evidence.get("sqnr_db"),
        "global_gradient_sqnr_db": twin.evidence.get("global_sqnr_db")})
    return [folded if f is named else f for f in findings if f is not twin]


def checked_fixes(findings: list[Finding], session: Session, reference_run: RunResult | None, *,
                  threshold_db: float, verify: bool, bisection: dict[str, Any] | None = None) -> list[Finding]:
    """``findings`` with every PRECISION_LOSS fix marked verified or not (see the module docstring).

    ``verify``: try a gradient PRECISION_LOSS's keep-fp32 advice (one or two whole steps; the
    diagnosis's ``bisect``).  An activation PRECISION_LOSS's fix is verified by the keep-fp32 search
    (``evidence.verified_fix``); when the search (``bisection``: its JSON) kept the module in fp32
    alone and that did not fix the step, the advice is replaced (``refused_fix``).
    """
    out = []
    for f in findings:
        if f.code != "PRECISION_LOSS" or "fix_verified" in f.evidence:
            out.append(f)
        elif "verified_fix" in f.evidence:
            v = f.evidence["verified_fix"]
            out.append(_marked(f, f.fix, bool(v.get("verified")), v.get("output_sqnr_db")))
        elif is_borderline(f) or f.evidence.get("judged_by") == "spread":
            out.append(_marked(f, f.fix, False))  # no change asked for, or the fix already says what was tried
        elif (f.evidence.get("kind") == "gradient" and verify and reference_run is not None and f.module
              and session.exclusion == "keep_fp32"):
            out.append(_gradient_fix(f, session, reference_run, threshold_db))
        elif (session.exclusion == "keep_fp32" and (alone := _tried_alone(f, bisection)) is not None
              and not alone["fixed"]):
            out.append(refused_fix(f, alone, str((bisection or {}).get("reason", "")), threshold_db))
        else:
            why = ("the keep-fp32 search did not verify it" if verify else
                   "this step was not re-run with it, the diagnosis ran without its keep-fp32 search")
            out.append(_marked(f, f"Not verified ({why}). {f.fix}", False))
    return out


def _marked(f: Finding, fix: str, verified: bool, sqnr: float | None = None, **extra: Any) -> Finding:
    evidence = {**f.evidence, "fix_verified": verified, **extra}
    if sqnr is not None:
        evidence["fix_sqnr_db"] = sqnr
    return dataclasses.replace(f, fix=fix + preflight_hint_of(f.fix), evidence=evidence)


def _gradient_fix(f: Finding, session: Session, reference_run: RunResult, threshold_db: float) -> Finding:
    """Try keeping the module, then its enclosing block, in fp32; offer the first that restores the gradient."""
    name = f.module or ""
    parent = name.rpartition(".")[0]
    tried: list[dict[str, Any]] = []
    for keep in [name, *([parent] if parent else [])]:
        v = verify_keep_fp32(session, [keep], reference_run)
        got = (v.get("grad_module_sqnr_db") or {}).get(name)
        tried.append({"keep_fp32": [keep], "gradient_sqnr_db": got, "finite": v.get("finite")})
        if got is not None and got >= threshold_db:
            alone = (f" Keeping {name!r} alone was tried and left it at {_db(tried[0]['gradient_sqnr_db'])}."
                     if keep != name else "")
            fix = (f"Verified fix: MixedPrecision(..., keep_fp32=[{keep!r}]) — re-running this step with it brings "
                   f"the gradient of {display_module(name)} from {_db(f.evidence.get('sqnr_db'))} to {_db(got)} SQNR "
                   f"against fp32 (threshold {threshold_db:g} dB).{alone}")
            return _marked(f, fix, True, got, fix_tried=tried, verified_fix=v)
    reached = [t["gradient_sqnr_db"] for t in tried if t["gradient_sqnr_db"] is not None]
    what = " and ".join(f"keep_fp32={t['keep_fp32']!r} leaves it at {_db(t['gradient_sqnr_db'])}" for t in tried)
    scale = (f"In fp16 raise the loss scale first (it was {session.program.loss_scale:g}): with too low a scale "
             "small gradients lose their precision, and MixedPrecision('fp16') scales dynamically. "
             if session.precision.name == "fp16" else "")
    fix = (f"Keeping {name!r} in fp32 was tried and did not help: re-running this step, {what} (threshold "
           f"{threshold_db:g} dB), so the loss is not made by {display_module(name)}'s own arithmetic: the gradient "
           f"reaching it comes through the {session.precision.name} backward of the layers after it. {scale}"
           "Confirm that it matters with `ampkit verify` against fp32; if it does, train in fp32, or keep the layers "
           f"downstream of {display_module(name)} in fp32 and verify that again.")
    return _marked(f, fix, False, max(reached) if reached else None, fix_tried=tried)


def _tried_alone(f: Finding, bisection: dict[str, Any] | None) -> dict[str, Any] | None:
    """The keep-fp32 search's trial of ``f``'s module alone in fp32, if it ran one."""
    return next((t for t in (bisection or {}).get("trials", []) if t.get("keep_fp32") == [f.module]), None)


def refused_fix(f: Finding, trial: dict[str, Any], reason: str, threshold_db: float) -> Finding:
    """``f`` (activation PRECISION_LOSS) whose keep-fp32 advice the search tried alone (``trial``) without a fix.

    >>> f = Finding(code="PRECISION_LOSS", severity="warning", message="m", fix="Keep 'a' in fp32", module="a",
    ...             evidence={"kind": "activation", "sqnr_db": 8.0})
    >>> trial = {"keep_fp32": ["a"], "fixed": False, "sqnr_db": {"a": 9.0, "": 12.5}}
    >>> g = refused_fix(f, trial, "no set of up to 10 modules kept in fp32 fixed the step", 20.0)
    >>> g.evidence["fix_verified"], g.evidence["fix_sqnr_db"], g.fix.split(":")[0]
    (False, 12.5, "Keeping 'a' in fp32 was tried and did not help")
    """
    name = f.module or ""
    out = trial.get("sqnr_db", {}).get("")
    own = trial.get("sqnr_db", {}).get(name)
    mine = f", its own output {_db(own)}" if own is not None and name else ""
    fix = (f"Keeping {name!r} in fp32 was tried and did not help: re-running this step with keep_fp32=[{name!r}], "
           f"the model output is {_db(out)} SQNR against fp32{mine} (threshold {threshold_db:g} dB)"
           + (f"; {reason}" if reason else "") + ". Confirm that it matters with `ampkit verify` against fp32; if it "
           "does, train this model in fp32, or compute the sensitive part of this module in fp32 (reductions, "
           "exp/log, long accumulations) and verify that again.")
    return _marked(f, fix, False, out, fix_tried=[{"keep_fp32": [name], "output_sqnr_db": out, "fixed": False}])
