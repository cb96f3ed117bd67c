"""``ReplayDoctor``: zero cost until failure, then a full diagnosis of the failing step.

``MixedPrecision(..., doctor=True)`` installs one.  Every step it keeps a *capture*: the
``diagnose.capture.Capture`` of each call of a prepared model that autograd records, made by its
``CaptureHooks`` (inputs, outputs and the gradients the outputs received, before a narrowing cast too,
kept by reference; the RNG, autocast and running-statistics state before the call; a prepared model
called inside another one's forward is part of the outer call's replay), plus the loss tensors given to
``mp.backward`` and the scale the step used (``StepResult.scale``).  The loss function is not known to
the engine, so the replay (``diagnose.replay``) re-runs the model on the captured inputs and
backpropagates the captured output gradients: everything inside the model is re-traced, the loss
itself is not.

Deciding whether a step failed costs no host sync in the hot path: at the boundary the
doctor queues ``[found_inf > 0, any loss non-finite]`` on the device.  On the CPU that
tensor is already computed when it is read (CPU kernels are synchronous), so it is read at
once; on an accelerator it is copied into pinned memory with ``non_blocking=True`` and an
event, and read at a later hook (the next forward or boundary) once ``event.query()`` says it
has arrived — never by waiting (``torch.Event``: CUDA, XPU, MPS alike).  A failed step (skipped, or non-finite loss) is replayed on
a deep copy of the model, fully instrumented (``ampkit.diagnose.step.api``), and its findings are
appended to ``findings`` and logged on the ``ampkit.doctor`` logger.

A skipped step with a finite loss that the replay shows to be ordinary dynamic loss scaling
(the overflow vanishes at scale 1) is reported once; later skips of the same kind are not
replayed again.  At most ``max_replays`` automatic replays run per engine.  ``replay(reason)``
replays the last completed step on demand (telemetry alarms call it with
``reason="SCALE_COLLAPSE"``, which adds a SCALE_COLLAPSE finding with the cause classified).

Memory: the capture of the last completed step stays referenced until the next step
completes — its model inputs (alive anyway for most loaders) and the gradient of the model's
outputs (for a language model, batch × sequence × vocabulary floats), so ``replay()`` can run
on demand.  ``keep_last=False`` drops a healthy step's capture at its boundary instead (then
``replay()`` only has a step that failed).

Replay timing: the replay must run on the weights the failing step used.  On the CPU the
flag is read before the optimizer step (``before_optimizer_step``; a framework's loop calls
``before_update``), so a failing step is replayed before its update, even when the update is
applied (no loss scaling and ``skip_nonfinite=False``, or a framework's bf16 loop); on an
accelerator the decision arrives at ``after_step`` or later, and the replay runs with the
parameters of then (recorded as ``evidence.params_from_step``: the optimizer steps taken).

One cause, one finding: once a replay reported an error, a later failing step whose weights
are already non-finite is its consequence — it is not replayed, and its step is added to that
finding's ``evidence.consequence_steps``.  Non-finite parameters seen by one replay are one
finding (``evidence.parameters``); ``evidence.weights`` says whether they were the step's own
(``before_step``: an earlier step wrote the inf/NaN) or those its applied update left (``after_update``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from typing_extensions import override

from ampkit._util.host import HostCopy
from ampkit.diagnose.capture import Capture, CaptureHooks
from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.live.findings import (
    fold_consequence,
    fold_parameters,
    loss_finding,
    scale_collapse_finding,
    seed_finding,
    weights_nonfinite,
)
from ampkit.findings import Finding
from ampkit.hooks import EngineHook, HookedEngine, HookEvent, StepResult

if TYPE_CHECKING:
    from ampkit.diagnose.step.result import DiagnosisResult

__all__ = ["ReplayDoctor"]

log = logging.getLogger("ampkit.doctor")


@dataclass
class StepCapture:
    """What one optimizer step ran: its forwards (``Capture``), losses and the scale it used."""

    step: int
    calls: list[Capture]
    losses: list[torch.Tensor]
    scale: float | torch.Tensor
    """A 0-d tensor is read (``float``) on the replay path only."""
    grad_accumulation: int
    has_found_inf: bool = False
    flag: HostCopy | None = None
    models: list[nn.Module] = field(default_factory=list)


def failure_flag(found_inf: torch.Tensor | None, losses: list[torch.Tensor]) -> torch.Tensor | None:
    """``[found_inf > 0 (when given), any loss non-finite (when any)]`` on the device: no host read."""
    parts = []
    if found_inf is not None:
        parts.append(found_inf.reshape(1) > 0)
    if losses:
        # A loss may be non-scalar (mp.backward(out, gradient=...)): every element must be finite.
        finite = torch.stack([torch.isfinite(x).all() for x in losses])
        parts.append((~finite).any().reshape(1))
    return torch.cat([p.to(parts[0].device) for p in parts]) if parts else None


@dataclass(frozen=True)
class FlagInputs:
    """The tensors a failure flag was read from, and whether they were written since (version counters)."""

    found_inf: torch.Tensor | None
    found_inf_version: int
    losses: list[torch.Tensor]
    loss_versions: tuple[int, ...]

    @classmethod
    def of(cls, found_inf: torch.Tensor | None, losses: list[torch.Tensor]) -> FlagInputs:
        return cls(found_inf, -1 if found_inf is None else found_inf._version, losses,
                   tuple(loss._version for loss in losses))

    def unchanged(self, found_inf: torch.Tensor | None, losses: list[torch.Tensor]) -> bool:
        """Whether ``found_inf`` and ``losses`` are the very objects read, none written since."""
        return (found_inf is self.found_inf and losses is self.losses
                and (found_inf is None or found_inf._version == self.found_inf_version)
                and tuple(loss._version for loss in losses) == self.loss_versions)


class ReplayDoctor(EngineHook):
    """Capture every step cheaply; replay a failing one fully instrumented (see the module docstring).

    Attach it with ``MixedPrecision(..., hooks=[ReplayDoctor(max_replays=...)])`` or the
    shorthand ``MixedPrecision(..., doctor=True)``; it binds to the engine in ``on_attach``.

    Args:
        max_replays: automatic replays per engine (explicit ``replay()`` calls are not counted).
        shadow, bisect: passed to the diagnosis (FP32 shadow comparison, keep-fp32 bisection).
        keep_last: keep the last healthy step's capture for ``replay()`` (see "Memory" above).
    """

    def __init__(self, *, max_replays: int = 3, shadow: bool = True,
                 bisect: bool = True, keep_last: bool = True) -> None:
        self.engine: HookedEngine | None = None
        self.keep_last = keep_last
        self.max_replays = max_replays
        self.shadow = shadow
        self.bisect = bisect
        self.findings: list[Finding] = []
        """Every finding of every replay, in the order they were found."""
        self.results: list[DiagnosisResult] = []
        self.replays = 0
        """Automatic replays run so far."""
        # Unbounded window and gradients: a step's every micro-batch can be replayed (see "Memory").
        self.hooks = CaptureHooks(on_root_enter=self._poll, grad_only=True, max_captures=None,
                                  grad_capture_numel=None)
        """The forwards of the current step (``diagnose.capture``)."""
        self._losses: list[torch.Tensor] = []
        self._last: StepCapture | None = None
        self._pending: list[StepCapture] = []
        self._replaying = False
        self._scaling_ok = False
        self._loss_reported = False
        self._warned_unprepared = False
        self._early: StepCapture | None = None
        """The step decided before its update (``before_update``), closed at its ``after_step``."""
        self._healthy_flag: FlagInputs | None = None
        """What ``before_update`` read a healthy flag from; ``after_step`` reads it again only if these changed."""
        self._origin: Finding | None = None
        """The first error of the last replay that found one: later failures on non-finite weights fold into it."""

    # -- engine hooks ------------------------------------------------------------------------
    @override
    def on_attach(self, engine: HookedEngine) -> None:
        """Bind to ``engine`` and hook the models it has already prepared."""
        if self.engine is not None and self.engine is not engine:
            raise ValueError("this ReplayDoctor is already attached to another engine; build one per engine")
        self.engine = engine
        for model in engine.models:
            self.hooks.add_root(model)

    @override
    def on_prepare(self, engine: HookedEngine, model: nn.Module) -> None:
        self.hooks.add_root(model)

    @override
    def on_event(self, engine: HookedEngine, event: HookEvent) -> bool | None:
        """``kind="replay"`` (a telemetry alarm): replay the last step with ``reason=event.reason``."""
        if event.kind != "replay":
            return None
        self.replay(reason=event.reason or "manual")
        return True

    @override
    def on_backward(self, engine: HookedEngine, loss: torch.Tensor) -> None:
        if self._replaying:
            return
        if not self.hooks.roots and not self._warned_unprepared:
            self._warned_unprepared = True
            log.warning("MixedPrecision(doctor=True) captures the inputs of prepared models only; call "
                        "mp.prepare(model) before training so a failing step can be replayed")
        self._losses.append(loss.detach())
        self.hooks.on_backward([loss], loss, None)

    @override
    def before_optimizer_step(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.before_update(engine.optimizer_steps + 1, found_inf, engine.scale)

    def before_update(self, step: int, found_inf: torch.Tensor | None, scale: torch.Tensor | float | None) -> None:
        """Step ``step``'s gradients are ready and the optimizer has not applied them yet.

        On the CPU (the flag costs no wait) a failing step is replayed now, on the weights it ran
        with: once an unchecked update has applied its NaN, a replay would see only non-finite
        weights.  Otherwise nothing happens here, and ``after_step`` decides.
        """
        if self._replaying or self._early is not None or self._bound().device.type != "cpu" or not self.hooks.captures:
            return
        flag = failure_flag(found_inf, self._losses)
        flags = flag.tolist() if flag is not None else []
        if not any(flags):
            # Healthy so far; after_step decides with the step's final found_inf, which a later hook may
            # still change.  Remembered so that after_step skips a second read when nothing changed (the
            # flag is a handful of small kernels, about 0.1 ms a step on a CPU).
            self._healthy_flag = FlagInputs.of(found_inf, self._losses)
            return
        scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale  # updated in place later
        self._early = self._close(step, scale, found_inf)
        self._decide(self._early, flags)

    @override
    def after_step(self, engine: HookedEngine, result: StepResult, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self._replaying:
            return
        if self._early is not None:  # decided (and replayed) before its update
            self._early, self._losses = None, []
            self.hooks.new_window()
            return
        cap = self._close(result.optimizer_step, result.scale, result.found_inf)
        healthy, self._healthy_flag = self._healthy_flag, None
        if healthy is not None and healthy.unchanged(result.found_inf, cap.losses):
            self._decide(cap, [False])  # the flag before_update read from these very tensors
            return
        flag = failure_flag(result.found_inf, cap.losses)
        if flag is None:
            return
        if flag.device.type == "cpu":
            # Free: CPU kernels have already run, so reading the flag waits for nothing.
            self._decide(cap, flag.tolist())
            return
        cap.flag = HostCopy(flag)  # queued behind the step's kernels; read once it has landed
        self._pending.append(cap)
        self._poll()

    def _close(self, step: int, scale: torch.Tensor | float | None, found_inf: torch.Tensor | None) -> StepCapture:
        """The capture of step ``step``, which becomes the last one; a new one begins."""
        calls = self.hooks.new_window()
        cap = StepCapture(step=step, calls=calls, losses=self._losses,
                          scale=scale if scale is not None else 1.0, grad_accumulation=self._bound().grad_accumulation,
                          has_found_inf=found_inf is not None, models=list({id(c.root): c.root for c in calls}.values()))
        self._losses = []
        self._last = cap
        return cap

    def _bound(self) -> HookedEngine:
        if self.engine is None:
            raise RuntimeError("ReplayDoctor is not attached to an engine: pass it in MixedPrecision(..., hooks=[...])")
        return self.engine

    @override
    def close(self) -> None:
        """Remove the capture hooks from every model."""
        self.hooks.remove()
        self.hooks.roots.clear()

    # -- deciding and replaying --------------------------------------------------------------------
    def _poll(self) -> None:
        while self._pending:
            cap = self._pending[0]
            if cap.flag is not None and not cap.flag.ready():
                return
            self._pending.pop(0)
            assert cap.flag is not None
            self._decide(cap, cap.flag.tolist())

    def _decide(self, cap: StepCapture, flags: list[bool]) -> None:
        skipped = bool(flags[0]) if cap.has_found_inf else False
        loss_bad = bool(flags[-1]) if cap.losses else False
        if not (skipped or loss_bad):
            if not self.keep_last and self._last is cap:
                self._last = None
            return
        if self._origin is not None and weights_nonfinite(cap.models):
            self._origin = fold_consequence(self.findings, self._origin, cap.step)
            log.debug("ampkit doctor: step %d failed on weights made non-finite before it: folded into %s of "
                      "step %s", cap.step, self._origin.code, self._origin.step)
            return
        if not loss_bad and self._scaling_ok:
            return  # another overflow of ordinary dynamic loss scaling, already explained
        if self.replays >= self.max_replays:
            if self.replays == self.max_replays:
                log.warning("ampkit doctor: step %d failed; not replayed (max_replays=%d reached)", cap.step,
                            self.max_replays)
                self.replays += 1
            return
        self.replays += 1
        # Decided after an update that was applied: the replay sees the weights that update wrote.
        after = cap is not self._early and not skipped
        self._run(cap, "non-finite loss" if loss_bad else "skipped step (non-finite gradients)", after_update=after)

    def replay(self, reason: str = "manual") -> list[Finding]:
        """Replay the last completed step fully instrumented and return its findings.

        With ``reason="SCALE_COLLAPSE"`` a SCALE_COLLAPSE finding with the cause classified
        (non-finite data or loss versus real gradient overflow) is added.
        """
        cap = self._last
        if cap is None or not cap.calls:
            log.warning("ampkit doctor: nothing to replay (%s): no step of a prepared model was captured", reason)
            return []
        found = self._run(cap, reason)
        if reason == "SCALE_COLLAPSE":
            collapse = scale_collapse_finding(found, cap.step, float(cap.scale))
            self.findings.append(collapse)
            found = sort_findings([collapse, *found])
        return found

    def _run(self, cap: StepCapture, reason: str, *, after_update: bool = False) -> list[Finding]:
        # Imported on the first replay: the op-level diagnosis is not loaded into healthy runs.
        from ampkit.diagnose.replay import replay

        scale = float(cap.scale)
        engine = self._bound()
        found: list[Finding] = []
        self._replaying = self.hooks.paused = True
        try:
            for call in cap.calls:
                call.scale = scale / cap.grad_accumulation  # the factor the captured output gradients carry
                seed_finite = call.grads_finite() is not False
                result = replay(call, engine.precision, shadow=self.shadow, bisect=self.bisect, step=cap.step)
                result.findings = [_with_context(f, reason, engine.optimizer_steps) for f in result.findings]
                if not seed_finite and not result.has_errors:
                    result.findings = sort_findings([seed_finding(cap.losses, call.root, cap.step, scale), *result.findings])
                self.results.append(result)
                found.extend(result.findings)
                if result.has_errors:
                    break
        except Exception as exc:  # a diagnosis must never take the training run down
            log.warning("ampkit doctor: replay of step %d failed: %s: %s", cap.step, type(exc).__name__, exc)
            return []
        finally:
            self._replaying = self.hooks.paused = False
        if any(f.code == "BACKWARD_OVERFLOW" and f.severity == "info" for f in found):
            self._scaling_ok = True
        low = loss_finding(cap.losses, cap.step, float(cap.scale))
        if low is not None and not self._loss_reported:
            self._loss_reported = True
            found.append(low)
        found = sort_findings(fold_parameters(found, cap.step, after_update=after_update))
        self.findings.extend(found)
        self._origin = next((f for f in found if f.severity == "error"), self._origin)
        _log(cap.step, reason, found)
        return found


def _with_context(f: Finding, reason: str, now: int) -> Finding:
    return replace(f, evidence={**f.evidence, "replay_reason": reason, "params_from_step": now})


def _log(step: int, reason: str, findings: list[Finding]) -> None:
    for f in findings:
        if f.severity == "info":
            continue
        where = " ".join(x for x in (f.module and f"in {f.module}", f.op and f"({f.op})",
                                      f.location and f"at {f.location}") if x)
        log.warning("ampkit doctor: step %d (%s): %s %s %s — %s", step, reason, f.severity.upper(), f.code, where,
                    f.message)
