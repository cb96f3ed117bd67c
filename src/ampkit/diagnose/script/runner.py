"""``ampkit doctor SCRIPT``: run an unmodified training script under observation.

The script runs as ``__main__`` the way ``coverage run`` runs it (``script.target.run_as_main``:
``sys.argv = [SCRIPT, *ARGS]``, ``sys.path[0]`` the script's folder; ``-m`` as ``python -m``).
Before it starts, the watchers (``ampkit.diagnose.script.watchers``, behind ``script.context``) wrap
autocast, GradScaler, backward, optimizers, LR schedulers, gradient clipping and
``torch.save``/``torch.load``, and hook the models the script calls; afterwards everything is
restored, also when the script crashed.

During the run, a step that the GradScaler skips, or whose loss or gradients are non-finite,
is replayed op by op (``diagnose.replay``) right away, while the model still holds that step's
weights: the first failure of each cause (gradient overflows, usually ordinary dynamic
scaling, at their 1st, 4th and 16th occurrence until one is an error), at most
``max_replays``.  When no replay found an error, one *checkup* replays the last captured step
with the FP32 shadow (precision loss, gradient underflow).  A known exception is explained
with the user's line; when it was raised inside a model's forward, that forward is replayed
to name the op.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampkit._util.frames import UserFrames
from ampkit._util.heartbeat import Heartbeat
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.core.modules import float_tensors
from ampkit.diagnose.replay import replay, replay_precision
from ampkit.diagnose.script import failures
from ampkit.diagnose.script.checkup import checkup_ran, checkup_record, checkup_skipped_reason
from ampkit.diagnose.script.compiled import compare_last_step
from ampkit.diagnose.script.context import Context
from ampkit.diagnose.script.ending import SIGNAL_EXIT_STATUS, ScriptTerminated, trap_ends
from ampkit.diagnose.script.errors import explain_exception
from ampkit.diagnose.script.mixed import mixed_precision_record, requested_flags
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.outcome import ScriptReport, merge_replayed_findings
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.rules import finalize
from ampkit.diagnose.script.state import Failure, FailureCause, Sampler
from ampkit.diagnose.script.target import ScriptTarget, defined_tasks, run_as_main, script_target
from ampkit.diagnose.script.tracebacks import print_user_traceback
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

__all__ = ["HEARTBEAT_S", "ScriptReport", "merge_replayed_findings", "run_script"]

HEARTBEAT_S = 10.0
"""The end-of-run analysis (checkup replay, keep-fp32 search, ...) prints a progress line this often
when it runs longer: a minute of silence after the script's last line looks like a hang."""


class _Runner:
    def __init__(self, script: ScriptTarget, args: Sequence[str], *, intended: str | None, replay: bool,
                 checkup: bool, bisect: bool, max_replays: int, sampler: Sampler | None, measure_speed: bool,
                 on_os_exit: Callable[[ScriptReport], int] | None = None, compare_compiled: bool = False,
                 heartbeat_s: float = HEARTBEAT_S):
        self.script, self.args = script, list(args)
        self.on_os_exit = on_os_exit
        self._globals: dict[str, Any] = {}
        self._patches = PatchSet()
        self.intended, self.replay, self.checkup, self.bisect = intended, replay, checkup, bisect
        self.max_replays, self.measure_speed, self.compare_compiled = max_replays, measure_speed, compare_compiled
        self.user_paths = [str(script.folder)]
        self.code = UserFrames(self.user_paths)
        self.ctx = Context(self.code, on_failure=self._on_failure, sampler=sampler)
        self.diagnoses: list[DiagnosisResult] = []
        self.replays: list[dict[str, Any]] = []
        self.explained: list[Finding] = []
        self._causes: dict[FailureCause, int] = {}
        self._replayed_roots: list[torch.nn.Module] = []
        self._settled: set[FailureCause] = set()
        self._replay_lock = threading.RLock()
        self.heartbeat = Heartbeat("ampkit doctor", every_s=heartbeat_s)
        self.checkup_record: dict[str, Any] = {}
        """``ScriptReport.checkup``: whether the end-of-run fp32 checkup ran, on which step, else why not."""

    # -- replays -------------------------------------------------------------------------------
    def _replay(self, cap: Capture, why: str, step: int | None) -> DiagnosisResult | None:
        if not self.replay or (len(self.diagnoses) >= self.max_replays and why != "checkup"):
            return None
        # One replay at a time: replays of failures in two training threads would restore the RNG
        # and patch autocast under each other.
        with self._replay_lock, self.ctx.state.pause():
            try:
                how = replay_precision(cap, self.intended)
                result = None if how is None else replay(cap, how[0], autocast=how[1], step=step, bisect=self.bisect,
                                                         user_paths=self.user_paths, on_progress=self.heartbeat.beat)
            except Exception as exc:  # a replay must never take the user's run down
                self.replays.append({"why": why, "step": step, "error": f"{type(exc).__name__}: {exc}"})
                print(f"ampkit doctor: could not replay step {step} ({why}): {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                if why == "checkup":
                    self.checkup_record = checkup_record("failed", step, f"{type(exc).__name__}: {exc}")
                return None
            if result is None:
                return None
            self.diagnoses.append(result)  # under the lock: diagnoses and their roots stay paired
            self._replayed_roots.append(cap.root)
            self.replays.append({"why": why, "step": step, "precision": result.precision,
                                 "findings": [f.code for f in result.findings], "keep_fp32": result.keep_fp32})
            return result

    def _on_failure(self, failure: Failure) -> None:
        """Replay the first failure of each cause.  Gradient overflows are replayed at their 1st, 4th
        and 16th occurrence until one is an error: early ones are usually ordinary dynamic scaling."""
        caps = [c for c in failure.captures if replay_precision(c, self.intended) is not None]
        seen = self._causes[failure.cause] = self._causes.get(failure.cause, 0) + 1
        if not caps or failure.cause in self._settled:
            return  # nothing ran in low precision: not a mixed-precision failure
        if failure.cause == "gradient_overflow" and seen not in (1, 4, 16):
            return
        cap = self._pick(caps, failure)
        if cap is None:
            return
        result = self._replay(cap, f"{failure.kind}:{failure.cause}", failure.step)
        if result is not None and failure.cause in ("gradient_overflow", "nonfinite_loss"):
            codes = {f.code for f in result.findings if f.severity == "error"}
            if codes & {"FORWARD_OVERFLOW", "FORWARD_NAN", "CAST_OVERFLOW"}:
                failures.reclassify(self.ctx.state, failure.step, "nonfinite_loss"
                                    if failure.cause == "nonfinite_loss" else "nonfinite_forward")
            elif any(f.code == "BACKWARD_OVERFLOW" and "singularity" in f.evidence for f in result.findings):
                failures.reclassify(self.ctx.state, failure.step, "gradient_singularity")
        if failure.cause != "gradient_overflow" or (result is not None and result.has_errors):
            self._settled.add(failure.cause)

    def _pick(self, caps: list[Capture], failure: Failure) -> Capture | None:
        """The captured forward whose replay can show the failure, or None when it lies outside every model.

        * non-finite data: the forward that received it;
        * non-finite loss: the first forward whose output is non-finite; when all outputs are finite the
          loss code between the models and the loss produced it (a process-level finding);
        * gradient overflow: a forward whose output and incoming gradient are finite (the overflow
          is inside it); else a forward whose output holds inf/NaN that the finite loss ignored
          (masked positions); when every incoming gradient is non-finite, the overflow happened
          between the outputs and the loss, in code no replay of a model can show.
        """
        if failure.cause == "nonfinite_data":
            return next((c for c in reversed(caps) if any(not bool(torch.isfinite(x).all())
                                                          for x in float_tensors((c.args, c.kwargs)))), caps[-1])
        if failure.cause == "nonfinite_loss":
            # The first bad value decides: the earliest forward of the window whose output is non-finite
            # (a frozen teacher's, before the student that reads it).
            bad = next((c for c in caps if not c.outputs_finite()), None)
            if bad is None:
                failures.loss_code_nonfinite(self.ctx.state, caps[-1], failure)
            return bad
        if failure.cause == "gradient_overflow":
            if failures.hidden_loss_code(self.ctx.state, self.ctx.state.models.label(caps[-1].root), failure):
                return None
            ok = [c for c in reversed(caps) if c.outputs_finite() and c.grads_finite() is not False]
            if ok:
                return ok[0]
            masked = next((c for c in reversed(caps) if not c.outputs_finite()), None)
            if masked is not None:
                return masked  # its forward went non-finite where the loss does not look (masked positions)
            failures.boundary_overflow(self.ctx.state, caps[-1], failure)
            return None
        return None

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> ScriptReport:
        self._patches = PatchSet()
        status, ended = 0, None
        crash: BaseException | None = None
        try:
            self.ctx.install(self._patches)
        except BaseException:
            self._patches.restore()
            raise
        try:
            with trap_ends(self._before_os_exit if self.on_os_exit is not None else None):
                self._globals = run_as_main(self.script, self.args)
        except SystemExit as exc:
            status = _exit_status(exc.code)
        except KeyboardInterrupt:
            status, ended = SIGNAL_EXIT_STATUS["sigint"], "sigint"
        except ScriptTerminated as exc:
            status, ended = SIGNAL_EXIT_STATUS[exc.ended], exc.ended
        except BaseException as exc:
            status, crash, ended = 1, exc, "exception"
        finally:
            self._patches.restore()
        return self._conclude(status, ended, crash)

    def _before_os_exit(self, status: int) -> int:
        """The script called ``os._exit(status)``: conclude, hand the report over, return the exit status."""
        self._patches.restore()
        report = self._conclude(_exit_status(status), "os_exit", None)
        return self.on_os_exit(report) if self.on_os_exit is not None else report.exit_status

    def _conclude(self, status: int, ended: str | None, crash: BaseException | None) -> ScriptReport:
        """The report of what was observed so far; after a signal, without the checkup replay
        (seconds of work the user just asked to stop); in a child the script forked, nothing (the
        parent reports the run: ``watchers.fork``)."""
        script = self.script.label
        state = self.ctx.state
        if self.ctx.forks.child:
            return ScriptReport(script=script, argv=self.args, findings=[], exit_status=status, ended=ended,
                                forked_child=True)
        if ended in SIGNAL_EXIT_STATUS:
            print(f"ampkit doctor: {ended.upper()} at step {state.step}; reporting the findings so far",
                  file=sys.stderr)
        if crash is not None:
            self._explain(crash)
        flags = requested_flags(self._globals)
        with self.heartbeat.phase(f"the script ended after {state.steps} optimizer step(s); analysing the run"):
            finalize(self.ctx, intended=self.intended, measure_speed=self.measure_speed, flags=flags)
            self._checkup(ended)
            comparison, diverged = compare_last_step(self.ctx,
                                                     self.compare_compiled and ended not in SIGNAL_EXIT_STATUS)
        models = state.models
        replayed = [_in_model(f, root, models) for d, root in zip(self.diagnoses, self._replayed_roots)
                    for f in d.findings]
        process = state.ledger.findings() + self.explained + diverged
        findings = self.ctx.casts.annotate(_with_verified_fix(merge_replayed_findings(process, replayed),
                                                              self.diagnoses), models)
        return ScriptReport(
            script=script, argv=self.args, findings=findings,
            diagnoses=self.diagnoses, exit_status=status, steps=state.steps, replays=self.replays,
            device=str(models.last.device) if models.last is not None else None,
            scalers=self._scaler_summary(), ended=ended, tasks=defined_tasks(self._globals),
            mixed_precision=mixed_precision_record(self.ctx, flags, self.intended),
            compiled=[c.to_dict() for c in self.ctx.compiles.calls],
            compiled_comparison=comparison.to_dict() if comparison is not None else None,
            checkup=self.checkup_record,
        )

    def _checkup(self, ended: str | None) -> None:
        """Replay the last captured forward against fp32 when no replay found an error, and record
        whether that happened (``ScriptReport.checkup``): a checkup that could not run must say so."""
        state = self.ctx.state
        last = state.models.last
        reason = checkup_skipped_reason(
            enabled=self.checkup and self.replay, signal=ended if ended in SIGNAL_EXIT_STATUS else None,
            errors=any(d.has_errors for d in self.diagnoses), observed=last is not None,
            corrupted_at=state.corrupted_by[2] if state.corrupted_by is not None else None)
        if reason is not None or last is None:
            self.checkup_record = checkup_record("skipped", last.step if last is not None else None, reason or "")
            return
        result = self._replay(last, "checkup", last.step)
        if result is not None:
            self.checkup_record = checkup_ran(result)
        elif not self.checkup_record:  # not a failure: the step ran in fp32
            self.checkup_record = checkup_record(
                "skipped", last.step, "the last captured step ran in fp32, so there is no low-precision step to "
                "compare; pass --precision bf16 or fp16 to check what that precision would do")

    def _scaler_summary(self) -> list[dict[str, Any]]:
        out, skips = [], self.ctx.state.skips
        for info in self.ctx.state.scalers.enabled_infos():
            scales = [s for _, s in info.scales]
            out.append({"created_at": info.location, "init_scale": info.init_scale, "updates": len(scales),
                        "final_scale": scales[-1] if scales else None, "min_scale": min(scales) if scales else None,
                        "skipped_steps": sorted(skips)[:64], "skipped": len(skips)})
        return out

    def _explain(self, exc: BaseException) -> None:
        state = self.ctx.state
        explained = exc is state.explained
        if not explained:
            finding = explain_exception(exc, self.code, state.models.named_modules(), step=state.step,
                                        models=state.models)
            if finding is not None:
                self.explained.append(finding)
                explained = True
        # The script's own traceback first, explained or not: its frames are where the user looks.
        print_user_traceback(exc, self.code, self._patches.wrapped)
        if explained:
            print(f"ampkit doctor: the script raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                  " (explained below)", file=sys.stderr)
            last = state.models.last
            if last is not None and _raised_inside(exc.__traceback__, last.root):
                self._replay(last, "exception", state.step)


def _in_model(f: Finding, root: Any, models: ModelWatch) -> Finding:
    """A replayed model's finding as the script's report names it: with several models, its module is
    prefixed by the model's label, and a keep-fp32 fix (whose names are relative to that model) says so."""
    name = models.qualify(root, f.module)
    if name == f.module:
        return f
    fix = f.fix
    if "keep_fp32" in fix:
        fix += f" (The names in keep_fp32 are relative to {models.label(root)}, the model where this happens.)"
    return dataclasses.replace(f, module=name, fix=fix)


def _with_verified_fix(findings: list[Finding], diagnoses: list[DiagnosisResult]) -> list[Finding]:
    """Point SCALE_COLLAPSE at the verified keep-fp32 set when a replay found one."""
    keep = next((d.keep_fp32 for d in diagnoses if d.keep_fp32), None)
    if keep is None:
        return findings
    return [dataclasses.replace(f, fix=f"{f.fix}. Verified on the replayed step: "
                                       f"MixedPrecision(..., keep_fp32={keep!r}) makes it finite",
                                evidence={**f.evidence, "keep_fp32": keep})
            if f.code == "SCALE_COLLAPSE" else f for f in findings]


def _raised_inside(tb: types.TracebackType | None, root: Any) -> bool:
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is root:
            return True
        tb = tb.tb_next
    return False


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_script(
    target: str | os.PathLike[str], args: Sequence[str] = (), *, module: bool = False, precision: str | None = None,
    replay: bool = True, checkup: bool = True, bisect: bool = True, max_replays: int = 3,
    sampler: Sampler | None = None, measure_speed: bool = True,
    on_os_exit: Callable[[ScriptReport], int] | None = None, compare_compiled: bool = False,
    heartbeat_s: float = HEARTBEAT_S,
) -> ScriptReport:
    """Run a training script as ``__main__`` under the doctor's watchers and return the findings.

    Args:
        target: the script's path (or, with ``module=True``, a module name as for ``python -m``).
        args: the script's own arguments (``sys.argv[1:]`` inside it).
        precision: the precision the op-level checkup uses when the script itself never enables
            autocast (``fp16``/``bf16``); ignored for steps that ran under autocast.
        replay: replay failing steps op by op; ``checkup``: replay one healthy step when none failed.
        bisect: search the minimal keep-fp32 set during replays.
        max_replays: at most this many op-level replays per run.
        sampler: which iterations are observed densely (``ampkit.diagnose.script.state.Sampler``).
        measure_speed: measure matmul throughput for SLOW_LOW_PRECISION (about 0.2 s once per process).

        on_os_exit: called with the report when the script calls ``os._exit(status)``; it returns the
            status the process exits with.  ``os._exit`` never returns, so without it the run's
            findings die with the process.  While the script runs, SIGTERM and SIGHUP end it like Ctrl-C does
            (``ScriptReport.ended``).
        compare_compiled: compare the last step compiled vs eager, module by module (``script.compiled``).
            The script itself runs eagerly under the doctor (``ScriptReport.compiled``).
        heartbeat_s: while the end-of-run analysis runs longer than this, a progress line on stderr
            every ``heartbeat_s`` seconds (what it is doing, how long it has taken).

    Raises:
        FileNotFoundError: ``target`` is not an existing file (``module=False``).
        ModuleNotFoundError: ``python -m target`` would find no module (``module=True``).
    """
    runner = _Runner(script_target(target, module=module), args, intended=precision, replay=replay, checkup=checkup,
                     bisect=bisect, max_replays=max_replays, sampler=sampler, measure_speed=measure_speed,
                     on_os_exit=on_os_exit, compare_compiled=compare_compiled, heartbeat_s=heartbeat_s)
    return runner.run()
