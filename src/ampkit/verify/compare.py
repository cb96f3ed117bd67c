"""Comparison of each precision's run against the fp32 baseline, and the pass/fail verdict.

Definitions (also in docs/verify.md and in every report):

- **loss-curve distance**: both loss curves are smoothed with a centred moving average of
  ``w`` steps (non-finite losses left out of each window) and
  ``d = mean_{t >= warmup} |S_p(t) − S_fp32(t)| / (max_t S_fp32(t) − min_t S_fp32(t))`` — the
  mean gap after warm-up in units of how far fp32's loss moved over the run.  Not relative to
  the loss value itself: a loss that trains towards 0 would turn a negligible gap into a huge
  ratio.  ``w = max(1, round(steps / 20))`` unless given.
- **metric worsening**: ``(value − fp32) / |fp32|`` for a lower-is-better metric and
  ``(fp32 − value) / |fp32|`` for a higher-is-better one; being better never fails.
- **speed-up**: samples/s of the run over fp32's, both measured after warm-up.
- **memory ratio**: the run's training memory over fp32's (CUDA: peak allocated bytes; CPU:
  peak RSS minus the peak reached before the model was built, so the interpreter and torch's
  own footprint, equal in every run, do not dilute the ratio).

A run fails when it crashed or diverged, when its initial weights or data differ from fp32's,
when a metric is non-finite or worse than ``tol.metric``, when the loss distance exceeds
``tol.loss``, when more than ``tol.skipped`` of its steps were skipped, when more than
``tol.nonfinite`` of its losses were non-finite, or (only if asked) when its speed-up is below
``tol.min_speedup``.

With the fp32 noise band (``ampkit.verify.noise``, on by default) the loss distance and each
metric get a three-way verdict: pass, fail, or inconclusive when the run cannot tell (too few
steps, or fp32's own run-to-run spread too wide for the tolerance).  A run's verdict is fail if
any check fails, else inconclusive if any check is, else pass.

Numerics and speed are judged apart: ``numerics`` is ``pass`` or ``fail`` on every check above
except the speed-up, and ``summary`` says both in one line ("numerics within tolerance; no
speed-up on this hardware (0.05x)").  A low precision slower than fp32 is a note, with the
hardware facts of ``ampkit env`` (``hardware``), never a failure unless ``--min-speedup`` asked.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ampkit.verify.noise import Judgement, judge, metric_band

if TYPE_CHECKING:  # record.py imports precision, so torch: the CLI's parser (lint included) reads this module
    from ampkit.verify.record import RunRecord

__all__ = ["LOSS_DISTANCE_DEFINITION", "NO_SPEEDUP", "Band", "Tolerances", "band_from_runs", "compare_runs",
           "loss_distance", "smooth"]

SPEED_REASON = "speed-up "
"""Every speed failure (``--min-speedup``) starts so; every other reason is about numerics."""
NO_SPEEDUP = "no speed-up on this hardware"

LOSS_DISTANCE_DEFINITION = (
    "d = mean over the steps after warm-up of |S_p(t) - S_fp32(t)|, divided by fp32's loss range "
    "max S_fp32 - min S_fp32 over the run, where S is the loss smoothed by a centred moving average of "
    "w steps (non-finite losses excluded): the mean gap in units of how far fp32's loss moved"
)


@dataclass(frozen=True, kw_only=True)
class Tolerances:
    """How far a low-precision run may drift from fp32 and still pass (see docs/verify.md)."""

    metric: float = 0.02
    """Largest relative worsening of any eval metric (about 4x the seed-to-seed spread of fp32; docs/verify.md)."""
    metric_overrides: dict[str, float] = field(default_factory=dict)
    """Per-metric replacements for ``metric`` (``--tol-metric NAME=VALUE``)."""
    loss: float = 0.03
    """Largest loss-curve distance (3 % of fp32's loss range: the low end of two fp32 seeds' distance)."""
    skipped: float = 0.05
    """Largest fraction of optimizer steps skipped for non-finite gradients (fp16 scale search)."""
    nonfinite: float = 0.0
    """Largest fraction of steps whose forward loss was non-finite (no loss scaler can fix a forward)."""
    min_speedup: float | None = None
    """When set, a run slower than this multiple of fp32's samples/s fails."""
    smooth: int | None = None
    """Moving-average window for the loss distance; None: ``max(1, round(steps / 20))``."""

    def window(self, steps: int) -> int:
        """The loss-smoothing window of a run of ``steps`` steps: ``smooth``, else ``max(1, round(steps / 20))``."""
        return self.smooth or max(1, round(steps / 20))

    def for_metric(self, name: str) -> float:
        return self.metric_overrides.get(name, self.metric)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def smooth(values: list[float | None], window: int) -> list[float]:
    """Centred moving average that skips missing/non-finite values (NaN where a window has none).

    >>> smooth([1.0, None, 3.0, 5.0], 3)
    [1.0, 2.0, 4.0, 4.0]
    """
    before, after = (window - 1) // 2, window // 2  # exactly `window` steps, centred (ties look ahead)
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - before): i + after + 1] if v is not None and math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def loss_distance(run: list[float | None], base: list[float | None], *, warmup: int, window: int) -> float:
    """The loss-curve distance defined above; ``inf`` when the curves cannot be compared.

    >>> base = [4.0, 3.0, 2.0, 1.0, 0.0]
    >>> round(loss_distance([4.0, 3.0, 2.2, 1.2, 0.2], base, warmup=2, window=1), 6)  # gap 0.2, range 4
    0.05
    """
    if len(run) != len(base) or len(base) <= warmup:
        return math.inf
    s_run, s_base = smooth(run, window), smooth(base, window)
    if any(math.isnan(x) for x in s_run[warmup:] + s_base):
        return math.inf
    gap = sum(abs(r - b) for r, b in zip(s_run[warmup:], s_base[warmup:])) / (len(base) - warmup)
    scale = max(s_base) - min(s_base)
    if scale <= 0:  # fp32's loss never moved: fall back to its level so the number stays finite
        scale = sum(abs(b) for b in s_base) / len(s_base)
    return gap / scale if scale > 0 else (0.0 if gap == 0 else math.inf)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _training_bytes(run: RunRecord) -> float | None:
    mem = run.get("memory") or {}
    value = mem.get("training_bytes")
    return float(value) if value is not None and value > 0 else None


def _fraction(count: int, total: int) -> float:
    return count / total if total else 0.0


def _own_checks(run: RunRecord, steps: int, tol: Tolerances, reasons: list[str]) -> dict[str, Any]:
    if run.get("status") != "ok":
        reasons.append(f"run {run.get('status', 'failed')}: {run.get('error') or 'no result'}")
    n = len(run.get("loss") or []) or steps
    skipped = _fraction(run.get("skipped_steps", 0), n)
    nonfinite = _fraction(run.get("nonfinite_steps", 0), n)
    if skipped > tol.skipped:
        reasons.append(f"{run.get('skipped_steps')} of {n} steps skipped ({skipped:.1%} > {tol.skipped:.1%} allowed)")
    if nonfinite > tol.nonfinite:
        reasons.append(f"{run.get('nonfinite_steps')} of {n} losses non-finite ({nonfinite:.1%} > {tol.nonfinite:.1%} allowed)")
    for name, value in (run.get("eval") or {}).items():
        if value is None:
            reasons.append(f"eval metric {name!r} is not finite")
    return {"skipped_fraction": skipped, "nonfinite_fraction": nonfinite}


@dataclass(frozen=True)
class Band:
    """The fp32 noise band a comparison is judged with (``ampkit.verify.noise``); None fields: unknown."""

    loss_distance: float | None
    metrics: dict[str, float | None]
    k: float
    missing: str | None = None
    """Why the band is unknown (the noise run failed), or None."""

    def to_dict(self) -> dict[str, Any]:
        return {"loss_distance": self.loss_distance, "metrics": dict(self.metrics), "k": self.k,
                "missing": self.missing}

    def judge(self, d: float, tol: float, band: float | None, resolved_steps: int, what: str) -> Judgement:
        missing = self.missing or (None if band is not None else "the noise run gave no value for it")
        return judge(d, tol, band=band, k=self.k, resolved_steps=resolved_steps, what=what, band_missing=missing)


def band_from_runs(base: RunRecord, noise: RunRecord | None, *, metrics: dict[str, str], steps: int,
                   warmup: int, tol: Tolerances, k: float) -> Band:
    """The fp32 noise band: the noise run's shadow losses and final metrics against the baseline's."""
    if base.get("status") != "ok":
        return Band(None, {}, k, missing="the fp32 baseline did not complete")
    if noise is None:
        return Band(None, {}, k, missing="the fp32 noise run failed: no result")
    if noise.get("status") != "ok":
        error = noise.get("error") or "no result"
        return Band(None, {}, k, missing=f"the fp32 noise run {noise.get('status', 'failed')}: {error}")
    window = tol.window(steps)
    dist = loss_distance(noise.get("shadow_loss") or [], base["loss"], warmup=warmup, window=window)
    widths = {name: metric_band((noise.get("eval") or {}).get(name), (base.get("eval") or {}).get(name))
              for name in metrics}
    return Band(dist if math.isfinite(dist) else None, widths, k)


def compare_runs(runs: list[RunRecord], *, metrics: dict[str, str], steps: int, warmup: int,
                 tol: Tolerances, environment: dict[str, Any] | None = None,
                 band: Band | None = None) -> list[dict[str, Any]]:
    """One comparison entry per run (fp32 first, as the baseline) with verdict and reasons.

    ``band``: the fp32 noise band; None is the single-run protocol (pass or fail only).
    """
    window = tol.window(steps)
    base = next((r for r in runs if r["precision"] == "fp32"), None)
    entries = []
    for run in runs:
        reasons: list[str] = []
        unsure: list[str] = []
        speed_reasons: list[str] = []
        notes: list[str] = []
        entry: dict[str, Any] = {"precision": run["precision"], "vs": "fp32", "baseline": run is base}
        entry.update(_own_checks(run, steps, tol, reasons))
        if base is None or base.get("status") != "ok":
            if run is not base:
                reasons.append("the fp32 baseline did not complete, so nothing can be compared")
        elif run is not base:
            entry.update(_against(run, base, metrics, warmup, window, tol, reasons, notes))
            entry["checks"] = _band_checks(entry, run, warmup, tol, band, reasons, unsure)
            speed_reasons = [r for r in reasons if r.startswith(SPEED_REASON)]
            reasons = [r for r in reasons if not r.startswith(SPEED_REASON)] + speed_reasons
            hardware = _hardware(run, environment or {}, entry.get("speedup"))
            if hardware is not None:
                entry["hardware"] = hardware
                notes.insert(0, hardware["note"])
        entry["loss_smoothing_window"] = window
        entry["numerics"] = "fail" if len(reasons) > len(speed_reasons) else "inconclusive" if unsure else "pass"
        entry["summary"] = _summary(entry, run is base, speed_reasons)
        entry["verdict"] = "fail" if reasons else "inconclusive" if unsure else "pass"
        resolved = f", each resolved: {band.k:g} x the fp32 noise band within it" if band is not None else ""
        entry["reasons"] = reasons + unsure or [f"within every tolerance{resolved}" if run is not base
                                                else "baseline completed"]
        entry["notes"] = notes
        entries.append(entry)
    return entries


def _against(run: RunRecord, base: RunRecord, metrics: dict[str, str], warmup: int, window: int,
             tol: Tolerances, reasons: list[str], notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["init_match"] = run.get("init_sha256") == base.get("init_sha256")
    out["data_match"] = run.get("data_sha256") == base.get("data_sha256")
    if run.get("init_sha256") and not out["init_match"]:
        reasons.append(f"initial weights differ from fp32's (sha256 {str(run.get('init_sha256'))[:12]} vs "
                       f"{str(base.get('init_sha256'))[:12]}): build_model(seed) is not deterministic")
    if run.get("data_sha256") and not out["data_match"]:
        reasons.append("the first batches differ from fp32's: batches(seed, device) is not deterministic")
    out["metrics"] = {}
    for name, direction in metrics.items():
        value, ref = (run.get("eval") or {}).get(name), (base.get("eval") or {}).get(name)
        item: dict[str, Any] = {"value": value, "baseline": ref, "direction": direction, "tolerance": tol.for_metric(name)}
        if value is not None and ref is not None:
            delta = value - ref
            worse = delta if direction == "lower" else -delta
            rel = worse / abs(ref) if ref != 0 else (0.0 if worse <= 0 else math.inf)
            item.update(delta=delta, relative_worse=rel, ok=rel <= tol.for_metric(name))
        else:
            item.update(delta=None, relative_worse=None, ok=False)
        out["metrics"][name] = item
    if run.get("status") == "ok":
        dist = loss_distance(run["loss"], base["loss"], warmup=warmup, window=window)
        out["loss_distance"] = dist if math.isfinite(dist) else None
        if not math.isfinite(dist):
            reasons.append("loss curves cannot be compared (non-finite over a whole smoothing window)")
        tail_run, tail_base = smooth(run["loss"], window)[-1], smooth(base["loss"], window)[-1]
        out["final_loss_delta"] = tail_run - tail_base if math.isfinite(tail_run - tail_base) else None
    else:
        out["loss_distance"], out["final_loss_delta"] = None, None
    rt, bt = run.get("throughput") or {}, base.get("throughput") or {}
    out["speedup"] = _ratio(rt.get("samples_per_s"), bt.get("samples_per_s"))
    out["memory_ratio"] = _ratio(_training_bytes(run), _training_bytes(base))
    speedup = out["speedup"]  # a speed-up below 1 is explained by compare_runs' hardware note
    if tol.min_speedup is not None and (speedup is None or speedup < tol.min_speedup):
        reasons.append(f"{SPEED_REASON}{speedup if speedup is None else f'{speedup:.2f}x'} below the required "
                       f"{tol.min_speedup:.2f}x")
    return out


def _summary(entry: dict[str, Any], baseline: bool, speed_reasons: list[str]) -> str:
    """Numerics and speed in one line, each judged on its own."""
    if baseline:
        return "baseline completed" if entry["numerics"] == "pass" else "baseline failed"
    numerics = {"pass": "numerics within tolerance", "fail": "numerics out of tolerance",
                "inconclusive": "numerics inconclusive"}[entry["numerics"]]
    speedup = entry.get("speedup")
    if speedup is None:
        speed = "speed-up not measured"
    elif speedup < 1.0:
        speed = f"{NO_SPEEDUP} ({speedup:.2f}x)"
    else:
        speed = f"{speedup:.2f}x the speed of fp32"
    return f"{numerics}; {speed}" + ("; below the required speed-up" if speed_reasons else "")


def _hardware(run: RunRecord, env: dict[str, Any], speedup: float | None) -> dict[str, Any] | None:
    """The ``ampkit env`` facts behind a missing speed-up: no fast path on the CPU, or a measured slowdown.

    None when the precision has a fast path and ran faster than fp32 (nothing to explain).
    """
    precision, device = run["precision"], str(run.get("device", "cpu")).split(":")[0]
    cpu = env.get("cpu") or {}
    fast = cpu.get(f"fast_{precision}") if device == "cpu" else None
    if precision.startswith("fp8") and device == "cpu":
        fast = False  # no CPU has fp8 GEMM units: torch's CPU _scaled_mm emulates them
    slow = speedup is not None and speedup < 1.0
    if fast is not False and not slow:
        return None
    facts: dict[str, Any] = {"device": device}
    if device == "cpu":
        flags = cpu.get("flags") or {}
        facts.update({"cpu_model": cpu.get("model"), f"fast_{precision}": fast,
                      "flags": {k: v for k, v in flags.items() if precision in k or k in ("avx512f", "avx2")},
                      "torch_capability": cpu.get("torch_capability")})
    tflops: dict[str, Any] = (env.get("matmul_tflops") or {}).get(device) or next(iter((env.get("matmul_tflops") or {}).values()), {})
    if tflops.get("fp32") and tflops.get(precision):
        facts["matmul_tflops"] = {"fp32": tflops["fp32"], precision: tflops[precision],
                                  "ratio": round(tflops[precision] / tflops["fp32"], 3)}
    if precision.startswith("fp8") and device == "cpu":
        why = ("CPUs have no fp8 GEMM units, so the fp8 layers ran on torch's emulating CPU _scaled_mm: the "
               "numerics are fp8's, the speed is not (fp8 GEMMs need CUDA compute capability 8.9 or later)")
    elif fast is False:
        why = (f"this CPU has no fast {precision} path (ampkit env: fast {precision} no"
               + "".join(f", {k} {'yes' if v else 'no'}" for k, v in (facts.get("flags") or {}).items()) + ")")
    else:
        why = f"{precision} ran slower than fp32 on this {device}"
    if facts.get("torch_capability"):
        why += f", torch kernels {facts['torch_capability']}"
    if "matmul_tflops" in facts:
        m = facts["matmul_tflops"]
        why += f"; matmul {precision} {m[precision]:g} vs fp32 {m['fp32']:g} TFLOP/s ({m['ratio']:.2f}x)"
    measured = f" (measured {speedup:.2f}x fp32)" if speedup is not None else ""
    note = f"{NO_SPEEDUP.capitalize()} for {precision}{measured}: {why}. The numerics are judged on their own."
    return {"fast_path": fast, "slower": slow, "facts": facts, "note": note}


def _band_checks(entry: dict[str, Any], run: RunRecord, warmup: int, tol: Tolerances, band: Band | None,
                 reasons: list[str], unsure: list[str]) -> list[dict[str, Any]]:
    """The loss distance and every metric, each judged against its tolerance (and the band, if any).

    A failing check's reason goes to ``reasons``, an inconclusive one's to ``unsure``; a value
    that could not be measured was already a reason of ``_against``.
    """
    resolved = max(0, len(run.get("loss") or []) - warmup)
    items: list[tuple[str, float | None, float, float | None, str]] = [
        ("loss_distance", entry.get("loss_distance"), tol.loss, band.loss_distance if band else None,
         "loss-curve distance")]
    for name, item in (entry.get("metrics") or {}).items():
        items.append((f"metric:{name}", item.get("relative_worse"), item["tolerance"],
                      band.metrics.get(name) if band else None,
                      f"{name} {item['value']:.4g} vs fp32 {item['baseline']:.4g}: worsening"
                      if item.get("relative_worse") is not None else name))
    checks = []
    for key, value, limit, width, what in items:
        if value is None:
            continue
        verdict = (band.judge(value, limit, width, resolved, what) if band is not None
                   else judge(value, limit, band=None, k=0.0, resolved_steps=None, what=what))
        checks.append({"check": key, "value": value, "tolerance": limit, "band": width,
                       "k": band.k if band else None, **verdict.to_dict()})
        if verdict.verdict == "fail":
            reasons.append(verdict.reason)
        elif verdict.verdict == "inconclusive":
            unsure.append(verdict.reason)
    return checks
