"""``Fp8FlushAlarm``: the flush fraction of an fp8 GEMM operand is high and rising.

The records of sampled steps carry ``fp8_flush_fraction`` per layer and operand (see
``fp8stats``).  The monitor keeps, per (layer, operand), the last ``window`` sampled fractions and
fires when the newest one is above ``max_fraction`` *and* at least ``factor`` times the lowest of
the previous ones (at least ``min_history`` of them).  It fires once per (layer, operand) and
re-arms when that operand's fraction falls back to ``max_fraction`` or below.  The doctor reports
the same problem of one replayed step as the finding FP8_FLUSH.  Evaluated on the host at flush time (no sync).

>>> monitor = Fp8FlushAlarm().monitor()
>>> events = [monitor.observe({"step": s, "rank": 0, "fp8_flush_fraction": {"0": {"input": f}}})
...           for s, f in ((1, 0.004), (101, 0.006), (201, 0.03))]
>>> events[:2], events[2].alarm, events[2].evidence["layer"], events[2].evidence["operand"]
([None, None], 'FP8_FLUSH', '0', 'input')
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from ampkit.telemetry.alarm_base import Alarm, AlarmEvent, Monitor, Record, check_threshold, is_int

__all__ = ["Fp8FlushAlarm"]


@dataclass(frozen=True, kw_only=True)
class Fp8FlushAlarm(Alarm):
    """An fp8 operand's flush fraction above ``max_fraction`` and ``factor`` x its recent low (``FP8_FLUSH``).

    Why these defaults.  With one scale per tensor, e4m3 flushes the values below about
    ``amax * 2.2e-6`` (half its smallest subnormal, 2**-10, over its maximum, 448) and e5m2 those below
    ``amax * 1.3e-10``.  For a roughly Gaussian operand whose amax is a few standard deviations that is
    ~1e-5 of the values; 1 % flushed takes an amax some 5000 standard deviations out, i.e. outliers
    that leave the bulk of the tensor with a few of fp8's 18 binades.  Near zero the flushed share
    grows about linearly with the amax, so a doubling (``factor=2``) means the outliers doubled relative
    to the bulk; the sampling noise of a 1 % share of a tensor of 10**4 or more elements is a few
    percent of it, far below 2x.  Taking the lowest of the last ``window=5`` samples as the baseline
    (500 steps at the default sampling) ignores a single low sample's noise and catches a drift that a
    step-to-step comparison would miss; two earlier samples are enough to call it a rise.
    """

    max_fraction: float = 0.01
    """Flush fraction above which an operand can fire (healthy operands flush ~1e-5 of their values)."""
    factor: float = 2.0
    """How many times the lowest fraction of the window the newest must be (a rise, not a level)."""
    window: int = 5
    """Previous sampled steps the baseline is taken over."""
    min_history: int = 2
    """Previous samples needed before the rule can fire."""

    name = "FP8_FLUSH"

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        check_threshold(cls, "max_fraction", self.max_fraction, 0 <= self.max_fraction < 1, "in [0, 1)")
        check_threshold(cls, "factor", self.factor, self.factor > 1, "> 1")
        check_threshold(cls, "window", self.window, is_int(self.window, 1), "an int >= 1")
        check_threshold(cls, "min_history", self.min_history,
                        is_int(self.min_history, 1) and self.min_history <= self.window, "an int in [1, window]")

    def monitor(self) -> Monitor:
        return _Fp8FlushMonitor(self)


class _Fp8FlushMonitor(Monitor):
    config: Fp8FlushAlarm

    def __init__(self, config: Fp8FlushAlarm) -> None:
        super().__init__(config)
        self.history: dict[str, deque[float]] = {}
        self.firing: set[str] = set()

    @override
    def observe(self, record: Record) -> AlarmEvent | None:
        fractions = record.get("fp8_flush_fraction")
        if not fractions:
            return None
        cfg = self.config
        hits: list[tuple[float, str, str, float, int]] = []
        for layer, ops in fractions.items():
            for op, f in ops.items():
                if f is None or f != f:  # not observed this step, or NaN
                    continue
                key = f"{layer}/{op}"
                past = self.history.setdefault(key, deque(maxlen=cfg.window))
                if f <= cfg.max_fraction:
                    self.firing.discard(key)
                elif len(past) >= cfg.min_history and f >= cfg.factor * min(past) and key not in self.firing:
                    self.firing.add(key)
                    hits.append((f, layer, op, min(past), len(past)))
                past.append(f)
        self.fired = bool(self.firing)
        if not hits:
            return None
        f, layer, op, low, n = max(hits)
        others = [f"{lay}/{o}" for _, lay, o, _, _ in sorted(hits, reverse=True)[1:]]
        message = (f"{f:.2%} of the non-zero {op} values of fp8 layer {layer!r} flush to zero in fp8, up from "
                   f"{low:.2%} over the last {n} sampled steps (max_fraction={cfg.max_fraction:.2%}, "
                   f"factor={cfg.factor:g})" + (f"; also {', '.join(others[:8])}" if others else ""))
        fix = (f"a growing amax (see fp8_amax) squeezes the rest of the tensor below fp8's range: keep the layer out "
               f"of fp8 (fp8_filter=[{layer!r}]), use precision='fp8-rowwise' (a scale per row isolates an outlier "
               "row), or tame the outliers (normalise the layer's input, lower the learning rate)")
        evidence = {"layer": layer, "operand": op, "flush_fraction": f, "baseline": low, "samples": n,
                    "amax": (record.get("fp8_amax") or {}).get(layer, {}).get(op), "also": others}
        return self._event(record, code=None, cause="fp8_flush", message=message, fix=fix, evidence=evidence)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "history": {k: list(v) for k, v in self.history.items()},
                "firing": sorted(self.firing)}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.history = {k: deque((float(x) for x in v), maxlen=self.config.window)
                        for k, v in state.get("history", {}).items()}
        self.firing = set(state.get("firing", []))
