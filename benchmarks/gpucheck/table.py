"""The sections of the GPU check, their time caps, and every pass/fail threshold: one table each.

docs/gpu-check.md prints the same thresholds; a test keeps the two equal.

>>> [s.name for s in SECTIONS][:3]
['bitexact', 'nosync', 'ratios']
>>> judge("ratios.engine_vs_recipe", 1.01), judge("ratios.engine_vs_recipe", 1.05)
('pass', 'fail')
>>> judge("ratios.replay_vs_step", 120.0)
'reported'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SECTIONS", "THRESHOLDS", "TOTAL_BUDGET_S", "Section", "Threshold", "judge", "section", "threshold"]

TOTAL_BUDGET_S = 225.0
"""The script's own budget, start to written report: 4 minutes less 15 s for ``make gpu-check``'s
install of ampkit, so that the whole command stays within 4 minutes."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """One section of the check."""

    name: str
    """What ``--only`` takes."""
    cap_s: float
    """Wall-clock cap of the section's process (import, CUDA start-up and work); past it, it is killed
    and recorded as "timed out"."""
    needs_cuda: bool = False
    """Only meaningful on CUDA (sync-debug mode, NCCL): skipped on any other device."""
    what: str
    """One line for the report."""


SECTIONS: tuple[Section, ...] = (
    Section(name="bitexact", cap_s=30, what="engine against the hand-written torch.amp recipe, bit for bit"),
    Section(name="nosync", cap_s=25, needs_cuda=True,
            what="20 fp16 steps with fused AdamW under torch.cuda.set_sync_debug_mode('error')"),
    Section(name="ratios", cap_s=45, what="step-time ratios, interleaved, median after warm-up"),
    Section(name="replay", cap_s=25, what="an injected overflow replayed through the accelerator path"),
    Section(name="verify", cap_s=70, what="ampkit verify on a 12-layer x 768 GPT: fp32, bf16, fp16"),
    Section(name="nccl", cap_s=20, needs_cuda=True,
            what="1-rank NCCL group: distributed.setup and a DCP checkpoint round trip"),
    Section(name="frameworks", cap_s=40, what="Hugging Face Trainer fp16: scale on resume, skip and backoff"),
)
"""In run order; the caps add up to less than ``TOTAL_BUDGET_S`` with room for start-up and the report."""


@dataclass(frozen=True, kw_only=True)
class Threshold:
    """How one check is judged."""

    key: str
    """``section.check``."""
    rule: str
    """``max``: measured <= limit; ``holds``: the measured condition is true; ``reported``: not judged."""
    limit: float | None = None
    text: str
    """The threshold in words, as the report and the docs print it."""


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold(key="bitexact.recipe", rule="holds",
              text="parameters, optimizer state and loss scale bitwise equal to the recipe's"),
    Threshold(key="nosync.steps", rule="holds", text="no sync error in 20 steps"),
    Threshold(key="ratios.engine_vs_recipe", rule="max", limit=1.02, text="<= 1.02"),
    Threshold(key="ratios.telemetry_vs_bare", rule="max", limit=1.02, text="<= 1.02"),
    Threshold(key="ratios.doctor_vs_bare", rule="max", limit=1.02, text="<= 1.02"),
    Threshold(key="ratios.replay_vs_step", rule="reported", text="reported"),
    Threshold(key="replay.culprit", rule="holds",
              text="culprit (code, module, op) equal to a CPU replay's of the same step"),
    Threshold(key="verify.run", rule="reported", text="reported: speed-up, peak memory, tokens/s, bf16 MFU"),
    Threshold(key="nccl.setup", rule="holds", text="distributed.setup passes and a skip is taken"),
    Threshold(key="nccl.dcp_round_trip", rule="holds", text="loaded state bitwise equal to the saved state"),
    Threshold(key="frameworks.scale_round_trip", rule="holds", text="resumed loss scale equals the saved one"),
    Threshold(key="frameworks.skip_backoff", rule="holds",
              text="skipped step, scale backed off, SCHEDULER_STEPPED_ON_SKIP reported"),
)


def threshold(key: str) -> Threshold:
    """The threshold of ``key`` (``section.check``); KeyError names the known keys."""
    for t in THRESHOLDS:
        if t.key == key:
            return t
    raise KeyError(f"no threshold {key!r}; known: {', '.join(t.key for t in THRESHOLDS)}")


def section(name: str) -> Section:
    for s in SECTIONS:
        if s.name == name:
            return s
    raise KeyError(name)


def judge(key: str, measured: Any) -> str:
    """``pass``, ``fail`` or ``reported`` for ``measured`` under the threshold of ``key``."""
    t = threshold(key)
    if t.rule == "reported":
        return "reported"
    if t.rule == "max":
        assert t.limit is not None
        return "pass" if measured is not None and float(measured) <= t.limit else "fail"
    return "pass" if bool(measured) else "fail"
