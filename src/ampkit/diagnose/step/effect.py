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
"""

from __future__ import annotations

import dataclasses
import math

from ampkit.diagnose.core.display import display_module, fp8_filter_fix, keep_fp32_fix
from ampkit.diagnose.step.bisect import BisectOutcome, kept_phrase
from ampkit.findings import Finding

__all__ = ["effect_finding", "fold_gradient_twin", "spread_finding"]


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
