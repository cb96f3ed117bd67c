"""``ReplayDoctor``: zero cost until failure, then a full diagnosis of the failing step.

``MixedPrecision(..., doctor=True)`` installs one.  Every step it keeps a *capture*:

* references to the inputs of each call of a prepared model (a forward pre-hook; no copy —
  the batch is alive anyway — so an input buffer the training code overwrites in place is
  seen with its new contents at replay time); a prepared model called inside another one's
  forward is not captured again: the outer call's replay runs it;
* the RNG state before that call (``torch.get_rng_state``: a 5 KB host copy; on CUDA the
  generator's seed and offset, read from host memory without a device sync) and the autocast
  state;
* the gradient each model output received in backward (a tensor hook that stores a
  reference: the loss function is not known to the engine, so the replay re-runs the model
  on the captured inputs and backpropagates this gradient — everything inside the model is
  re-traced, the loss itself is not).  When the output is consumed by a cast (``.float()``
  before the loss, autocast's fp32 loss ops), the gradient *before* that cast is kept too
  (a pre-hook on the cast's autograd node, found by a walk of at most 64 nodes from the loss
  in ``on_backward``): a scale that overflows fp16 exactly at that boundary is then replayed
  faithfully, and judged at scale 1;
* the loss tensors given to ``mp.backward`` and the scale the step used (``StepResult.scale``).

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

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ampkit._util.autograd import sole_cast_consumers
from ampkit._util.host import HostCopy
from ampkit._util.modhooks import own_hook
from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.core.modules import float_tensors
from ampkit.diagnose.live.capture import (
    Call,
    GradKeeper,
    StepCapture,
    WideKeeper,
    failure_flag,
    replay_program,
    scale_value,
)
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
        self._hooked: dict[int, list[RemovableHandle]] = {}
        self._calls: list[Call] = []
        self._losses: list[torch.Tensor] = []
        self._last: StepCapture | None = None
        self._pending: list[StepCapture] = []
        self._replaying = False
        self._scaling_ok = False
        self._loss_reported = False
        self._warned_unprepared = False
        self._out_nodes: dict[Any, tuple[Call, int]] = {}
        self._depth = 0
        """Hooked models running now: a call made inside another is part of the outer one's replay."""
        self._early: StepCapture | None = None
        """The step decided before its update (``before_update``), closed at its ``after_step``."""
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
            self._hook(model)

    @override
    def on_prepare(self, engine: HookedEngine, model: nn.Module) -> None:
        self._hook(model)

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
        if not self._hooked and not self._warned_unprepared:
            self._warned_unprepared = True
            log.warning("MixedPrecision(doctor=True) captures the inputs of prepared models only; call "
                        "mp.prepare(model) before training so a failing step can be replayed")
        self._losses.append(loss.detach())
        if self._out_nodes and loss.grad_fn is not None:
            self._hook_casts(loss.grad_fn)

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
        if self._replaying or self._early is not None or self._bound().device.type != "cpu" or not self._calls:
            return
        flag = failure_flag(found_inf, self._losses)
        flags = flag.tolist() if flag is not None else []
        if not any(flags):
            return  # healthy so far; after_step decides with the step's final found_inf
        scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale  # updated in place later
        self._early = self._close(step, scale, found_inf)
        self._decide(self._early, flags)

    @override
    def after_step(self, engine: HookedEngine, result: StepResult, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self._replaying:
            return
        if self._early is not None:  # decided (and replayed) before its update
            self._early, self._calls, self._losses, self._out_nodes = None, [], [], {}
            return
        cap = self._close(result.optimizer_step, result.scale, result.found_inf)
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
        cap = StepCapture(step=step, calls=self._calls, losses=self._losses,
                           scale=scale if scale is not None else 1.0, grad_accumulation=self._bound().grad_accumulation,
                           has_found_inf=found_inf is not None, models=list({id(c.model): c.model
                                                                             for c in self._calls}.values()))
        self._calls, self._losses = [], []
        self._out_nodes = {}
        self._last = cap
        return cap

    def _bound(self) -> HookedEngine:
        if self.engine is None:
            raise RuntimeError("ReplayDoctor is not attached to an engine: pass it in MixedPrecision(..., hooks=[...])")
        return self.engine

    # -- capture hooks ---------------------------------------------------------------------------
    def _hook(self, model: nn.Module) -> None:
        if id(model) in self._hooked:
            return
        self._hooked[id(model)] = [
            model.register_forward_pre_hook(own_hook(model, self._pre_hook), with_kwargs=True),
            # always_call: a forward that raises still leaves the nesting depth balanced
            model.register_forward_hook(own_hook(model, self._post_hook), with_kwargs=True, always_call=True),
        ]

    @override
    def close(self) -> None:
        """Remove the capture hooks from every model."""
        for handles in self._hooked.values():
            for h in handles:
                h.remove()
        self._hooked.clear()

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._depth += 1
        if self._depth > 1 or self._replaying or not torch.is_grad_enabled():
            return
        if self._pending:
            self._poll()
        dev = self._bound().device
        accel = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
        self._calls.append(Call(
            model=module, args=args, kwargs=kwargs, rng_cpu=torch.get_rng_state(), rng_accel=accel,
            autocast=(dev.type, torch.get_autocast_dtype(dev.type), torch.is_autocast_enabled(dev.type)),
        ))

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth > 0 or self._replaying or not self._calls or self._calls[-1].model is not module:
            return
        call = self._calls[-1]
        outs = [t for t in float_tensors(output) if t.requires_grad]
        call.grads = [None] * len(outs)
        call.wide = [None] * len(outs)
        for i, t in enumerate(outs):
            t.register_hook(GradKeeper(call.grads, i))
            if t.grad_fn is not None:
                self._out_nodes[t.grad_fn] = (call, i)

    def _hook_casts(self, root: Any) -> None:
        """Pre-hook the casts that are a captured output's sole consumer (``ampkit._util.autograd``)."""
        for out_node, cast in sole_cast_consumers([root], self._out_nodes).items():
            call, i = self._out_nodes[out_node]
            cast.register_prehook(WideKeeper(call.wide, i))

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
            collapse = scale_collapse_finding(found, cap.step, scale_value(cap))
            self.findings.append(collapse)
            found = sort_findings([collapse, *found])
        return found

    def _run(self, cap: StepCapture, reason: str, *, after_update: bool = False) -> list[Finding]:
        from ampkit.diagnose.step.api import diagnose_program
        from ampkit.diagnose.step.session import RngSnapshot, Session

        scale = scale_value(cap)
        effective = scale / cap.grad_accumulation  # the factor the captured output gradients carry
        found: list[Finding] = []
        self._replaying = True
        # A replay can start inside the caller's forward pre-hook (accelerators): leave its autocast
        # and grad mode outside, every program sets its own.
        clean = contextlib.ExitStack()
        clean.enter_context(torch.enable_grad())
        engine = self._bound()
        clean.enter_context(torch.autocast(engine.device.type, enabled=False))
        try:
            for call in cap.calls:
                program, seed_finite = replay_program(call, effective)
                session = Session(call.model, program, engine.precision,
                                  rng=RngSnapshot(engine.device, cpu=call.rng_cpu, accel=call.rng_accel))
                try:
                    result = diagnose_program(call.model, program, engine.precision, step=cap.step,
                                              shadow=self.shadow, bisect=self.bisect, session=session)
                finally:
                    session.close()
                result.findings = [_with_context(f, reason, engine.optimizer_steps) for f in result.findings]
                if not seed_finite and not any(f.severity == "error" for f in result.findings):
                    result.findings = sort_findings([seed_finding(cap.losses, call.model, cap.step, scale), *result.findings])
                self.results.append(result)
                found.extend(result.findings)
                if any(f.severity == "error" for f in result.findings):
                    break
        except Exception as exc:  # a diagnosis must never take the training run down
            log.warning("ampkit doctor: replay of step %d failed: %s: %s", cap.step, type(exc).__name__, exc)
            return []
        finally:
            clean.close()
            self._replaying = False
        if any(f.code == "BACKWARD_OVERFLOW" and f.severity == "info" for f in found):
            self._scaling_ok = True
        low = loss_finding(cap.losses, cap.step, scale_value(cap))
        if low is not None and not self._loss_reported:
            self._loss_reported = True
            found.append(low)
        found = sort_findings(fold_parameters(found, cap.step, after_update=after_update))
        self.findings.extend(found)
        self._origin = next((f for f in found if f.severity == "error"), self._origin)
        _log(cap.step, reason, found)
        return found


def _with_context(f: Finding, reason: str, now: int) -> Finding:
    from dataclasses import replace

    return replace(f, evidence={**f.evidence, "replay_reason": reason, "params_from_step": now})


def _log(step: int, reason: str, findings: list[Finding]) -> None:
    for f in findings:
        if f.severity == "info":
            continue
        where = " ".join(x for x in (f.module and f"in {f.module}", f.op and f"({f.op})",
                                      f.location and f"at {f.location}") if x)
        log.warning("ampkit doctor: step %d (%s): %s %s %s — %s", step, reason, f.severity.upper(), f.code, where,
                    f.message)
