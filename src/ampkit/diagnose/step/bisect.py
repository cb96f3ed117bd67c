"""Culprit bisection: the smallest set of modules that, kept in fp32, fixes the step.

Algorithm (a greedy that follows the failure, then a delta-debugging prune):

1. Candidates are ranked by the trace: producer modules first, then modules whose output
   SQNR first fell below the threshold (in forward order), then the lowest-SQNR modules.
2. Grow: keep the top candidate in fp32 (``ampkit.policy.keep_fp32`` on the working copy) and
   re-run the step.  If it is still non-finite, the *new* producer is added next (fixing one
   overflow often moves it to the next op, e.g. the cast into the following layer); if the
   SQNR target is still missed, the worst module still below it; else the next candidate.
3. Prune: drop each member whose removal keeps the step fixed (1-minimal set).
4. Verify: apply the final set to a fresh copy the way the engine does
   (``MixedPrecision(keep_fp32=[...])`` → ``Fp32Policy``), re-run, and record the loss, the
   gradients' finiteness and the SQNR against fp32 as evidence.

"Fixed" means: no exception, no forward producer of a non-finite value anywhere (an overflow
absorbed into a finite-but-wrong step counts), finite loss and gradients with the backward
judged at scale 1 (an overflow that only a high loss scale causes is the dynamic scaler's
job, not keep-fp32's), the model output's SQNR against fp32 at or above the threshold, and
every module that had PRECISION_LOSS back above it.  Names of repeated blocks collapse into a pattern
(``blocks.*.norm``) only when the pattern matches exactly the same modules.  Trials are
bounded (``max_trials``); each costs one (traced, when finiteness is the goal) step.

Precision loss is judged by its effect on the model's output (``scan``, before the grow step):
each candidate of ``effect_candidates`` is kept in fp32 *alone* and the step re-run, and the
model output's SQNR against fp32 is measured.  The module whose fp32 keeping restores the
output is the culprit (``effect_culprit``): a module with a good SQNR of its own often is the
one whose bf16 output rounded the signal away (a projection of timesteps, coordinates with an
offset), while the first module below the threshold only shows it.  The grow step then starts
from the candidates in the order of their effect, so a single-module fix costs no further
trial.  Before the singles, one trial keeps every candidate of the scan in fp32 together, the
most any subset of them can restore: when that does not fix the step and raises the output by
less than ``CULPRIT_GAIN_DB``, no subset fixes it and no single one is a culprit, so the loss is
spread over the model and the search stops after that one trial (``BisectOutcome.spread_gain_db``).
It is spread too when the singles run and none gains ``NO_EFFECT_DB``.

Cost: without a non-finite value to chase (``Objective.need_finite`` false) a trial is judged
by module outputs only, so it runs the forward alone, untraced: the scan costs one forward per
candidate (at most ``EFFECT_SCAN_LIMIT``), plus the one of all of them.  The final set is
verified with the whole step, backward included.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ampkit.diagnose.step import compare
from ampkit.diagnose.step.events import find_producer
from ampkit.diagnose.step.fp8 import filter_layers, out_of_fp8
from ampkit.diagnose.step.ownops import own_arithmetic_culprit
from ampkit.diagnose.step.session import RunResult, Session, copy_model
from ampkit.policy import Fp32Policy

__all__ = [
    "CULPRIT_GAIN_DB",
    "EFFECT_SCAN_LIMIT",
    "NO_EFFECT_DB",
    "BisectOutcome",
    "Objective",
    "Trial",
    "best_effect",
    "bisect_keep_fp32",
    "compress_names",
    "effect_candidates",
    "effect_culprit",
    "kept_phrase",
    "rank_candidates",
    "verify_keep_fp32",
]

EFFECT_SCAN_LIMIT = 16
"""Most single-module trials of the effect scan (each is one untraced forward)."""
CULPRIT_GAIN_DB = 3.0
"""A module that fixes nothing alone is still named the culprit when keeping it in fp32 raises the
output by this much (``effect_culprit``).  When every scanned module kept in fp32 *together* gains
less and does not fix the step, no single one can be a culprit nor a fix, so the singles are not
run: the loss is spread over the model."""
NO_EFFECT_DB = 1.0
"""Keeping every scanned module in fp32 together, or any one of them alone, gains less than this and
the step is not fixed: the loss is spread over the model, rounding that accumulates through many
layers, and no small keep-fp32 set removes it.  The search stops (on a ResNet-50 the singles and
the grow step cost 26 forwards for nothing).  When all of them together do fix the step (the same
loss in each of a few repeated blocks, fixed by ``blocks.*.fc``), the search goes on as usual."""


@dataclass
class Objective:
    need_finite: bool
    """The baseline step had a producer (non-finite or absorbed): each trial is traced, so a
    remaining or moved producer is seen and names the next module to add."""
    sqnr_modules: list[str]
    """Modules whose output SQNR must reach ``threshold_db``."""
    threshold_db: float
    reference: dict[str, list[list[torch.Tensor]]] | None
    """fp32 module outputs (needed for the SQNR target)."""


@dataclass
class Trial:
    keep: list[str]
    fixed: bool
    finite: bool
    sqnr_db: dict[str, float] = field(default_factory=dict)
    next_module: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"keep_fp32": self.keep, "fixed": self.fixed, "finite": self.finite, "sqnr_db": self.sqnr_db,
                "next": self.next_module, "error": self.error}


@dataclass
class BisectOutcome:
    keep_fp32: list[str] | None
    trials: list[Trial]
    verification: dict[str, Any] | None
    reason: str
    effects: dict[str, Trial] = field(default_factory=dict)
    """The effect scan: candidate -> its single-module trial (empty when no scan ran)."""
    culprit: str | None = None
    """The module whose fp32 keeping alone restores the output most (``effect_culprit``)."""
    spread_gain_db: float | None = None
    """Set when the search found the loss spread over the model: the output's gain, in dB, with all the
    scanned modules excluded together (the most any subset of them reached)."""
    spread_modules: int = 0
    """How many modules that trial excluded together."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keep_fp32": self.keep_fp32, "reason": self.reason, "verification": self.verification,
               "trials": [t.to_json() for t in self.trials]}
        if self.effects:
            out["effects"] = {m: t.sqnr_db for m, t in self.effects.items()}
            out["culprit"] = self.culprit
        if self.spread_gain_db is not None:
            out["spread_gain_db"], out["spread_modules"] = self.spread_gain_db, self.spread_modules
        return out


def rank_candidates(producers: list[str | None], out_sqnr: dict[str, float], *, order: list[str],
                    threshold_db: float, limit: int = 12) -> list[str]:
    """Producer modules, then modules below the SQNR threshold in forward order, then lowest SQNR.

    >>> rank_candidates(["b.norm"], {"a": 30.0, "b.norm": 5.0, "c": 12.0}, order=["a", "b.norm", "c"],
    ...                 threshold_db=20.0)
    ['b.norm', 'c', 'a']
    """
    out: list[str] = []

    def add(name: str | None) -> None:
        if name and name not in out:
            out.append(name)

    for p in producers:
        add(p)
    for n in order:
        v = out_sqnr.get(n, math.nan)
        if not math.isnan(v) and v < threshold_db:
            add(n)
    for n in sorted((n for n, v in out_sqnr.items() if not math.isnan(v)), key=lambda n: out_sqnr[n]):
        add(n)
    return out[:limit]


def effect_candidates(order: list[str], out_sqnr: dict[str, float], *, threshold_db: float,
                      limit: int = EFFECT_SCAN_LIMIT) -> list[str]:
    """Modules whose fp32 keeping may restore the output, for the effect scan.

    On a small model every module but the root, in forward order.  Otherwise the modules below
    the threshold (forward order), the ancestors of the first of them (a parent's own forward may
    compute what the child only receives), then the modules that completed before it, nearest
    first: a precision loss is produced at or upstream of where it first shows.

    >>> effect_candidates(["a", "b", "c", ""], {"b": 3.0}, threshold_db=20.0)
    ['a', 'b', 'c']
    >>> effect_candidates(["a", "b", "c.x", "c.y", "c", "d", ""], {"c.x": 3.0, "c.y": 9.0, "c": 9.0},
    ...                   threshold_db=20.0, limit=4)
    ['c.x', 'c.y', 'c', 'b']
    """
    names = [n for n in order if n]
    if len(names) <= limit:
        return names
    below = [n for n in names if not math.isnan(out_sqnr.get(n, math.nan)) and out_sqnr[n] < threshold_db]
    if not below:
        return names[:limit]
    first = below[0]
    ancestors = [n for n in names if first.startswith(n + ".")]
    upstream = list(reversed(names[: names.index(first)]))
    return list(dict.fromkeys([*below, *ancestors, *upstream]))[:limit]


def _floor(values: dict[str, float]) -> float:
    """The worst SQNR among ``values`` (NaN counts as lost)."""
    return min((-math.inf if math.isnan(v) else v for v in values.values()), default=-math.inf)


def effect_culprit(effects: dict[str, Trial], baseline: dict[str, float], *,
                   min_gain_db: float = CULPRIT_GAIN_DB) -> str | None:
    """The module whose fp32 keeping alone restores the output: the culprit of a precision loss.

    Among the single-module trials that fixed the step, the innermost (a parent that fixes it
    only because its child does is not the producer), then the one with the best model output;
    when none fixed it, the one that raised the worst target most, by at least ``min_gain_db``
    over ``baseline`` (the targets' SQNR without any module in fp32).

    >>> t = lambda fixed, out: Trial(keep=[], fixed=fixed, finite=True, sqnr_db={"": out})
    >>> effect_culprit({"enc": t(True, 40.0), "enc.proj": t(True, 38.0), "head": t(False, 2.0)}, {"": 1.0})
    'enc.proj'
    >>> effect_culprit({"a": t(False, 12.0), "b": t(False, 2.0)}, {"": 1.0})
    'a'
    >>> effect_culprit({"a": t(False, 2.0)}, {"": 1.0}) is None
    True
    """
    fixed = [n for n, t in effects.items() if t.fixed]
    if fixed:
        inner = [n for n in fixed if not any(o != n and o.startswith(n + ".") for o in fixed)]
        return max(inner, key=lambda n: _floor({"": effects[n].sqnr_db.get("", math.nan)}))
    if not effects:
        return None
    best, gain = best_effect(effects, baseline)
    return best if gain >= min_gain_db else None


def best_effect(effects: dict[str, Trial], baseline: dict[str, float]) -> tuple[str, float]:
    """The single-module trial that raised the worst target most, and by how many dB over ``baseline``.

    >>> t = lambda out: Trial(keep=[], fixed=False, finite=True, sqnr_db={"": out})
    >>> best_effect({"a": t(12.0), "b": t(2.5)}, {"": 2.0})
    ('a', 10.0)
    """
    floor = _floor({k: baseline.get(k, math.nan) for k in next(iter(effects.values())).sqnr_db})
    best = max(effects, key=lambda n: _floor(effects[n].sqnr_db))
    return best, _floor(effects[best].sqnr_db) - floor


def kept_phrase(exclusion: str) -> str:
    """What a trial did to a module, in words: ``kept in fp32``, or ``kept out of fp8`` (``fp8_filter``)."""
    return "kept out of fp8" if exclusion == "fp8_filter" else "kept in fp32"


def compress_names(names: list[str], all_names: list[str]) -> list[str]:
    """Replace repeated-block names by a pattern when it matches exactly the same modules.

    >>> compress_names(["h.0.ln", "h.1.ln", "head"], ["", "h", "h.0", "h.0.ln", "h.1", "h.1.ln", "head"])
    ['h.*.ln', 'head']
    """
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", n), []).append(n)
    out: list[str] = []
    for pattern, members in groups.items():
        if len(members) > 1 and set(fnmatch.filter(all_names, pattern)) == set(members):
            out.append(pattern)
        else:
            out.extend(members)
    return out


def _is_inside(name: str, others: list[str]) -> bool:
    return any(o != name and (o == "" or name.startswith(o + ".")) for o in others)


class _Bisector:
    def __init__(self, session: Session, objective: Objective, reference_run: RunResult | None, max_trials: int):
        self.s = session
        self.obj = objective
        self.ref = reference_run
        self.max_trials = max_trials
        self.trials: list[Trial] = []
        self._spent = 0
        """Trials of the effect scan: the grow and prune budgets count from here."""

    def _targets(self) -> list[str]:
        """Modules whose output SQNR the objective checks: the flagged ones and the model output."""
        if self.obj.reference is None:
            return []
        return [*self.obj.sqnr_modules, *([""] if "" not in self.obj.sqnr_modules else [])]

    def trial(self, keep: list[str]) -> Trial:
        s = self.s
        s.reset_work()
        targets = self._targets()
        if s.on_progress is not None:
            s.on_progress(f"keep-fp32 search, trial {len(self.trials) + 1}")
        # Without a non-finite value to chase, a trial is judged by module outputs alone: its
        # backward is skipped (half the trial), and the final set's verification runs the whole step.
        with s.kept_fp32(keep):
            r = s.run(s.work, mode="unit", trace=self.obj.need_finite, stats=False, backward=self.obj.need_finite,
                      reference=self.obj.reference if targets else None, only=set(targets) or None)
        s.reset_work()
        sqnr = compare.module_sqnr(r.recorder.energies) if targets else {}
        failing = sorted((m for m in targets if not sqnr.get(m, -math.inf) >= self.obj.threshold_db),
                         key=lambda m: sqnr.get(m, -math.inf))
        producer = None
        if r.log is not None:
            producer = find_producer(r.log, "forward") or (None if r.finite else find_producer(r.log, "backward"))
        t = Trial(keep=list(keep), finite=r.finite, fixed=r.finite and not failing and producer is None,
                  sqnr_db={m: sqnr.get(m, math.nan) for m in targets},
                  error=None if r.exception is None else f"{type(r.exception).__name__}: {r.exception}"[:300])
        if producer is not None:
            t.next_module = producer.record.module
        elif failing:
            t.next_module = failing[0]
        self.trials.append(t)
        return t

    def scan(self, candidates: list[str]) -> dict[str, Trial]:
        """Each candidate alone in fp32 (the effect scan of the module docstring)."""
        effects = {c: self.trial([c]) for c in dict.fromkeys(candidates) if c}
        self._spent = len(self.trials)
        return effects

    def grow(self, candidates: list[str]) -> list[str] | None:
        keep: list[str] = []
        queue = [c for c in candidates if c]
        last: Trial | None = None
        while len(self.trials) - self._spent < self.max_trials:
            nxt = last.next_module if last is not None else None
            if nxt is not None and (nxt == "" or nxt in keep or _is_inside(nxt, keep)):
                nxt = None  # already fp32 there: fp32 itself fails at this op, try the next candidate
            if nxt is None:
                nxt = next((c for c in queue if c not in keep and not _is_inside(c, keep)), None)
            if nxt is None:
                return None
            keep.append(nxt)
            last = self.trial(keep)
            if last.fixed:
                return keep
        return None

    def prune(self, keep: list[str]) -> list[str]:
        keep = [k for k in keep if not _is_inside(k, keep)]
        for member in list(keep):
            if len(keep) == 1 or len(self.trials) - self._spent >= 2 * self.max_trials:
                break
            smaller = [k for k in keep if k != member]
            if self.trial(smaller).fixed:
                keep = smaller
        return keep

    def verify(self, patterns: list[str]) -> dict[str, Any]:
        """Apply ``patterns`` to a fresh copy exactly as the engine would, and re-run the step."""
        s = self.s
        fresh = copy_model(s.model)
        targets = self._targets()
        with contextlib.ExitStack() as stack:
            if s.exclusion == "fp8_filter":
                applied = filter_layers(fresh, patterns)  # resolved as MixedPrecision(fp8_filter=...) does
                stack.enter_context(out_of_fp8(fresh, applied))
            else:
                applied = Fp32Policy(patterns, s.device.type).apply(fresh)
            r = s.run(fresh, mode="unit", trace=self.obj.need_finite, stats=False,
                      reference=self.obj.reference if targets else None, only=set(targets) or None)
        sqnr = compare.module_sqnr(r.recorder.energies) if targets else {}
        producer = find_producer(r.log, "forward") if r.log is not None else None
        evidence: dict[str, Any] = {
            s.exclusion: patterns, "modules": applied, "finite": r.finite, "loss": r.loss, "backward_scale": 1.0,
            "output_sqnr_db": sqnr.get(""), "module_sqnr_db": {m: sqnr.get(m) for m in self.obj.sqnr_modules},
            "trials": len(self.trials), "overflow_left": producer is not None,
        }
        if self.ref is not None and r.finite:
            grads = compare.compare_grads(self.ref.grads, r.grads, inv_scale=1.0, param_module=s.param_module)
            evidence["grad_sqnr_db"] = grads.global_sqnr_db
        failing = [m for m in targets if not (sqnr.get(m) or -math.inf) >= self.obj.threshold_db]
        evidence["verified"] = r.finite and r.exception is None and not failing and producer is None
        return evidence


def verify_keep_fp32(session: Session, patterns: list[str], reference_run: RunResult) -> dict[str, Any]:
    """Each module's gradient SQNR against ``reference_run`` with ``patterns`` kept in fp32: the check of a fix
    that no search proposed (a gradient PRECISION_LOSS's advice).  Applied to a fresh copy as the engine
    would, the whole step re-run at the step's own loss scale (the gradients are judged unscaled, as the
    finding was).  One step."""
    s = session
    fresh = copy_model(s.model)
    applied = Fp32Policy(patterns, s.device.type).apply(fresh)
    r = s.run(fresh, mode="scaled", stats=False)
    evidence: dict[str, Any] = {"keep_fp32": patterns, "modules": applied, "finite": r.finite}
    if r.finite and r.exception is None:
        grads = compare.compare_grads(
            reference_run.grads, r.grads, inv_scale=1.0 / s.program.loss_scale, param_module=s.param_module,
            flushed_below=compare.flush_bound(s.precision.dtype, s.program.loss_scale))
        evidence["grad_sqnr_db"], evidence["grad_module_sqnr_db"] = grads.global_sqnr_db, dict(grads.sqnr_db)
    return evidence


def bisect_keep_fp32(session: Session, objective: Objective, candidates: list[str], *,
                     reference_run: RunResult | None = None, max_trials: int = 10,
                     scan: list[str] | None = None, baseline: dict[str, float] | None = None) -> BisectOutcome:
    """Find, prune and verify a minimal keep-fp32 set (see the module docstring).

    ``scan``: candidates of the effect scan (each kept in fp32 alone first); ``baseline``: the
    targets' SQNR of the step as it ran, against which the scan's gain is judged.
    """
    b = _Bisector(session, objective, reference_run, max_trials)
    tried = [c for c in dict.fromkeys(scan or []) if c]
    together = b.trial(tried) if tried and not objective.need_finite else None
    # The gain of all of them together, when that ran cleanly and did not fix the step (else None).
    gain = None
    if together is not None and together.finite and together.error is None and not together.fixed:
        gain = _floor(together.sqnr_db) - _floor({k: (baseline or {}).get(k, math.nan) for k in together.sqnr_db})
    kept = kept_phrase(session.exclusion)
    if gain is not None and gain < CULPRIT_GAIN_DB:
        return BisectOutcome(None, b.trials, None,
                             f"spread: the {len(tried)} modules tried, {kept} all together, raised the output SQNR "
                             f"by {gain:+.2f} dB (under {CULPRIT_GAIN_DB:g} dB) and did not fix the step, so no "
                             "subset of them fixes it and none alone is a culprit", {}, None, gain, len(tried))
    effects = b.scan(tried) if tried else {}
    culprit = effect_culprit(effects, baseline or {}) if effects else None
    if b.s.exclusion == "keep_fp32":  # a child that fixed it only by dragging its parent's own ops into fp32
        culprit = own_arithmetic_culprit(effects, culprit, b.s, lambda: b.trial([]))
    if gain is not None and culprit is None and best_effect(effects, baseline or {})[1] < NO_EFFECT_DB:
        return BisectOutcome(None, b.trials, None,
                             f"spread: no module of the {len(effects)} tried, {kept} alone, raised the output SQNR "
                             f"by {NO_EFFECT_DB:g} dB, and all of them together ({gain:+.2f} dB) did not fix the step",
                             effects, None, gain, len(tried))
    if culprit is not None:
        ranked = sorted((c for c in effects if c != culprit), key=lambda c: -_floor(effects[c].sqnr_db))
        candidates = list(dict.fromkeys([culprit, *ranked, *candidates]))
    if not candidates:
        return BisectOutcome(None, [], None, "no module is a candidate (the problem is outside the model)")
    keep = [culprit] if culprit is not None and effects[culprit].fixed else b.grow(candidates)
    if keep is None:
        return BisectOutcome(None, b.trials, None,
                             f"no set of up to {len(b.trials)} modules kept in fp32 fixed the step", effects, culprit)
    keep = b.prune(keep)
    all_names = [n for n, _ in session.model.named_modules()]
    patterns = compress_names(keep, all_names)
    verification = b.verify(patterns)
    if not verification["verified"]:
        return BisectOutcome(None, b.trials, verification, "the proposed set did not verify on a fresh copy",
                             effects, culprit)
    return BisectOutcome(patterns, b.trials, verification, "verified", effects, culprit)
