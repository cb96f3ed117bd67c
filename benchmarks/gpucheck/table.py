"""The sections of the GPU check, their time caps, and every pass/fail threshold: one table each.

docs/gpu-check.md prints the same thresholds; a test keeps the two equal.

>>> [s.name for s in SECTIONS][:3]
['bitexact', 'nosync', 'ratios']
>>> judge("ratios.engine_vs_recipe", 1.01), judge("ratios.engine_vs_recipe", 1.05)
('pass', 'fail')
>>> judge("ratios.replay_vs_step", 120.0)
'reported'
>>> judge("fp8.mlp_speedup", 1.35), judge("fp8.mlp_speedup", 1.1)
('pass', 'fail')
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
    default: bool = True
    """Part of a run without ``--only``.  ``fp8`` is not: with its ``torch.compile`` of four models
    it needs most of a run's budget, so it is a call of its own, ``--only fp8``."""
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
    # Four compiled models (a GPT and a wide MLP block, each in bf16 and fp8): inductor's first
    # compile of the 12-layer GPT with torchao's Float8Linear is estimated at tens of seconds.
    Section(name="fp8", cap_s=200, default=False,
            what="fp8 (torchao float8): recipe bit for bit, the doctor's FP8_FLUSH, compiled speed vs bf16"),
)
"""In run order.  A run without ``--only`` runs the ``default`` sections in the order given here;
it starts each with the smaller of its cap and what is left of ``TOTAL_BUDGET_S``."""


@dataclass(frozen=True, kw_only=True)
class Threshold:
    """How one check is judged."""

    key: str
    """``section.check``."""
    rule: str
    """``max``: measured <= limit; ``min``: measured >= limit; ``holds``: the measured condition is true;
    ``reported``: not judged."""
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
    Threshold(key="fp8.recipe", rule="holds",
              text="parameters and optimizer state bitwise equal to torchao's float8 recipe's"),
    Threshold(key="fp8.doctor", rule="holds",
              text="FP8_FLUSH at the outlier's layer and operand, and the verified fp8_filter keeps that layer out"),
    # fp8 tokens/s over bf16's, both compiled.  fp8's dense tensor-core peak is twice bf16's on
    # Ada, Hopper and Blackwell; tensorwise fp8 then pays for an amax and a cast of each GEMM's
    # input, weight and grad_output (memory passes that grow with M*K where the GEMM grows with
    # M*K*N), and the GELU, the loss, the clip and the AdamW step cost the same in both arms.
    # An estimate for an H200 at 4096 x 16384 and 8192 tokens (6.6 TFLOP of GEMMs a step): bf16
    # GEMMs about 9 ms at 750 TFLOP/s, fp8 about 5 ms plus about 1 ms of casts, about 1.5 ms of
    # clip and AdamW in both, so about 1.5x.  1.2 fails a broken fp8 path (uncompiled, emulated,
    # or casts that are not fused: at or below bf16) with room for a slower fp8 GPU than estimated
    # here.  An estimate, not a measurement: the first GPU run's number goes to docs/gpu-results.md.
    Threshold(key="fp8.mlp_speedup", rule="min", limit=1.2, text=">= 1.2 (judged on a GPU only)"),
    # The 12 x 768 GPT's GEMMs (K, N of 768 to 3072) are small enough for the casts to eat most of
    # fp8's gain, and attention and the norms stay bf16: its speed-up can be below 1 on an H100.
    # Reported, so the number is on record; no threshold would say something about ampkit.
    Threshold(key="fp8.gpt_speedup", rule="reported", text="reported"),
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
    if t.rule in ("max", "min"):
        assert t.limit is not None
        if measured is None:
            return "fail"
        ok = float(measured) <= t.limit if t.rule == "max" else float(measured) >= t.limit
        return "pass" if ok else "fail"
    return "pass" if bool(measured) else "fail"
