"""What a section returns, and the small helpers every section shares.

A section's ``run(device, *, tiny)`` yields ``Check`` objects as they are made (the runner keeps those
made before a time-out); ``check()`` judges a measured
value against the section's threshold from ``table``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ampkit._util.dtensor import local_shard
from ampkit._util.speed import synchronize
from gpucheck.table import judge, threshold

__all__ = ["Check", "check", "first_difference", "median_ratio", "not_judged", "skipped", "timed"]


@dataclass
class Check:
    """One judged (or reported) measurement."""

    key: str
    """``section.check`` of its threshold in ``table.THRESHOLDS``."""
    name: str
    """This instance, e.g. ``fp16-accumulate-4`` (several checks can share a threshold)."""
    status: str
    """``pass``, ``fail``, ``reported``, ``skipped`` or ``error``."""
    measured: Any
    """The value judged: a number, a bool, or a small dict for reported results."""
    threshold: str
    detail: str = ""
    """What was compared, or why it failed, in words."""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check(key: str, name: str, measured: Any, detail: str = "", **evidence: Any) -> Check:
    """A ``Check`` judged by ``table.judge``."""
    return Check(key=key, name=name, status=judge(key, measured), measured=measured,
                 threshold=threshold(key).text, detail=detail, evidence=evidence)


def not_judged(key: str, name: str, measured: Any, detail: str, **evidence: Any) -> Check:
    """A measured ``Check`` whose threshold does not apply here (a speed threshold on a CPU): ``reported``."""
    return Check(key=key, name=name, status="reported", measured=measured, threshold=threshold(key).text,
                 detail=detail, evidence=evidence)


def skipped(key: str, name: str, why: str) -> Check:
    """A check that could not run here, with the reason (never a made-up result)."""
    return Check(key=key, name=name, status="skipped", measured=None, threshold=threshold(key).text, detail=why)


def first_difference(a: object, b: object, where: str) -> str | None:
    """Where two nested states (dicts, lists, tensors, DTensors, plain values) first differ, or None when bitwise equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = local_shard(a), local_shard(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(math.inf).max().item()
            return f"{where}: max |difference| {diff:.3g}"
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, its device work included (a sync on each edge)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median_ratio(device: torch.device, arms: dict[str, Callable[[], Any]], steps: int, warmup: int) -> dict[str, Any]:
    """Median step time of each arm, stepped interleaved in a rotating order, and the ratio of each to the first.

    The rotation means no arm always runs first (on a colder cache) or always last; each step is
    timed from a synchronised device to a synchronised device, so queued work is counted in the
    step that queued it.
    """
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            elapsed = timed(device, arms[name])
            if i >= warmup:
                times[name].append(elapsed)
    medians = {n: statistics.median(t) for n, t in times.items()}
    base = medians[names[0]]
    return {"median_ms": {n: m * 1e3 for n, m in medians.items()},
            "ratio": {n: medians[n] / base for n in names[1:]}, "steps": steps, "warmup": warmup}
