"""One diagnosis session: private copies of the model, a fixed RNG state, and single runs.

The user's model is never run, modified or given gradients: every run happens on a deep
copy (``copy_model``), whose parameters, buffers and hooks mirror the original (hook callables
are shared, not copied, so a hook bound to a large object does not drag a copy of it along).
Before every run the RNG state captured at the start is restored, so dropout draws the same
masks in the low-precision run, the fp32 shadow and every bisection trial; when the session
closes, the caller's RNG state is put back.

Memory: one low-precision copy and one fp32 copy of the parameters, plus every module output
of one step in fp32 while the shadow comparison runs.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit._util.dtypes import dtype_name
from ampkit._util.frames import UserFrames
from ampkit.diagnose.core.blockcast import quantized_layer_names
from ampkit.diagnose.core.modules import ModuleRecorder, module_of_param, upcast
from ampkit.diagnose.step.fp8 import fp8_precision, out_of_fp8, strip_fp8
from ampkit.diagnose.step.programs import ForwardOut, StepProgram
from ampkit.diagnose.step.trace import OpTracer, TraceLog
from ampkit.policy import is_kept, keep_fp32, release_fp32
from ampkit.precision import Precision

__all__ = ["RngSnapshot", "RunResult", "Session", "copy_model", "unwrap_model"]

_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module behind DDP/FSDP-style wrappers (``.module``) and ``torch.compile`` (``._orig_mod``)."""
    seen = 0
    while seen < 4:
        seen += 1
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def copy_model(model: nn.Module, *, fp32: bool = False) -> nn.Module:
    """A deep copy of ``model`` without gradients; ``fp32=True`` also upcasts fp16/bf16 tensors."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for attr in _HOOK_DICTS:
            for hook in getattr(m, attr, {}).values():
                memo[id(hook)] = hook
    clone = copy.deepcopy(model, memo)
    for p in clone.parameters():
        p.grad = None
    if fp32:
        clone._apply(upcast)
    return clone


def unwrap_autocast_forward(model: nn.Module) -> None:
    """Give back the modules of ``model`` (a private copy) their own ``forward``.

    Accelerate's ``prepare`` (and so the HF Trainer's) replaces ``forward`` on the instance with one
    that enters ``torch.autocast`` itself, keeping the original as ``_original_forward``.  Autocast
    disabled around the module cannot reach inside that call, so the fp32 reference would run in
    low precision and every comparison with it would read as perfect.
    """
    for m in model.modules():
        original = m.__dict__.get("_original_forward")
        if original is not None and "forward" in m.__dict__:
            m.forward = original


class RngSnapshot:
    """CPU and accelerator RNG states, captured once and restorable any number of times."""

    def __init__(self, device: torch.device, cpu: torch.Tensor | None = None, accel: torch.Tensor | None = None):
        self.device = device
        self.cpu = torch.get_rng_state() if cpu is None else cpu
        self.accel = accel
        if accel is None and device.type == "cuda":
            self.accel = torch.cuda.get_rng_state(device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accel is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(self.accel, self.device)


@dataclass
class RunResult:
    """What one run of the step program did."""

    recorder: ModuleRecorder
    log: TraceLog | None = None
    exception: BaseException | None = None
    loss: float | None = None
    loss_dtype: str | None = None
    loss_location: str | None = None
    loss_finite: bool = True
    grads_finite: bool = True
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite_grads: list[str] = field(default_factory=list)
    root_output: list[torch.Tensor] = field(default_factory=list)

    @property
    def finite(self) -> bool:
        return self.exception is None and self.loss_finite and self.grads_finite


class Session:
    """Copies of one model and the runs of one step program on them (see the module docstring)."""

    def __init__(self, model: nn.Module, program: StepProgram, precision: Precision, *,
                 user_paths: tuple[str, ...] = (), rng: RngSnapshot | None = None, call_site: str | None = None,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.model = unwrap_model(model)
        self.on_progress = on_progress
        """Told what a long search is doing (``ampkit doctor``'s heartbeat); None: quiet."""
        self.call_site = call_site
        """The user's line that called the model in the step being replayed (``ampkit doctor SCRIPT``): the
        place of the ops no user frame runs (a built-in module's), and the frames below a run, the
        doctor's own callers, are then never an op's place.  None: every user frame counts."""
        self.program = program
        self.precision = fp8_precision(precision, self.model)
        param = next(self.model.parameters(), None)
        self.device = param.device if param is not None else precision.device
        self._caller_rng = RngSnapshot(self.device)
        self.rng = rng or self._caller_rng
        self.frames = UserFrames(user_paths)
        self.param_module = module_of_param(self.model)
        self.work = copy_model(self.model)
        self.quantized = bool(quantized_layer_names(self.model))
        """Whether the model holds Linear layers in a low-precision GEMM format (``is_quantized_linear``)."""
        self.buffers_before = {n: b.detach().clone() for n, b in self.work.named_buffers()}

    def close(self) -> None:
        self._caller_rng.restore()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_work(self) -> None:
        """Put the working copy back to the state it was copied in (buffers, no grads)."""
        with torch.no_grad():
            for n, b in self.work.named_buffers():
                if n in self.buffers_before:
                    b.copy_(self.buffers_before[n])
        for p in self.work.parameters():
            p.grad = None

    @property
    def exclusion(self) -> str:
        """What a bisection trial does to its modules: ``keep_fp32``, or ``fp8_filter`` for a model whose Linear
        layers compute in a low-precision GEMM format (fp8, or an emulated block format: ``step.fp8``)."""
        return "fp8_filter" if self.precision.is_fp8 or self.quantized else "keep_fp32"

    def shadow_model(self) -> nn.Module:
        """An fp32 copy that runs entirely outside autocast (autocast is disabled at its root), and
        without fp8 or block-format casts (its quantized Linear layers become ``nn.Linear``, ``step.fp8``)."""
        shadow = strip_fp8(copy_model(self.model, fp32=True))
        unwrap_autocast_forward(shadow)
        keep_fp32(shadow, self.device.type)
        return shadow

    @contextlib.contextmanager
    def kept_fp32(self, names: list[str]) -> Any:
        """Temporarily keep the named modules of the working copy in fp32 (undone afterwards); for an
        fp8 model, out of fp8 instead (``fp8_filter``'s meaning: bf16 autocast, ``step.fp8.out_of_fp8``)."""
        if self.exclusion == "fp8_filter":
            with out_of_fp8(self.work, names):
                yield
            return
        modules = dict(self.work.named_modules())
        applied = []
        for n in names:
            m = modules[n]
            if not is_kept(m):
                keep_fp32(m, self.device.type)
                applied.append(m)
        try:
            yield
        finally:
            for m in applied:
                release_fp32(m)

    def run(self, model: nn.Module, *, mode: str, trace: bool = False, fp32: bool = False,
            stats: bool = True, keep_outputs: bool = False, backward: bool = True,
            reference: dict[str, list[list[torch.Tensor]]] | None = None, only: set[str] | None = None) -> RunResult:
        """One forward + backward of the program on ``model`` (a copy), recorded as asked.

        ``backward=False`` runs the forward only: for a question that only module outputs answer
        (the keep-fp32 search of a precision loss), it saves the backward, about half of the run.
        """
        self.rng.restore()
        for p in model.parameters():
            p.grad = None
        recorder = ModuleRecorder(model, stats=stats, keep_outputs=keep_outputs, reference=reference, only=only)
        result = RunResult(recorder=recorder)
        tracer: OpTracer | None = None
        fwd: ForwardOut | None = None
        with recorder:
            tracer = OpTracer(model, recorder, user_frames=self.frames, call_site=self.call_site,
                              stop=sys._getframe() if self.call_site is not None else None) if trace else None
            try:
                with tracer if tracer is not None else contextlib.nullcontext():
                    fwd = self.program.forward(model, fp32=fp32)
                    if tracer is not None:
                        if fwd.loss is not None:
                            slot = tracer.slot_of(fwd.loss)
                            origin = tracer.slots[slot].op_index if slot is not None else None
                            if origin is not None:
                                result.loss_location = tracer.records[origin].location
                        tracer.end_forward()
                    if backward:
                        self.program.backward(fwd, "fp32" if fp32 else mode)
            except Exception as exc:  # the caller turns known errors into findings and re-raises the rest
                result.exception = exc
            if tracer is not None:
                tracer.stop = None  # the frame of this call: a reference cycle holding the run's tensors otherwise
                tracer.finalize()
                result.log = TraceLog.from_tracer(tracer)
        result.root_output = recorder.root_output
        if fwd is not None and fwd.loss is not None:
            result.loss_dtype = dtype_name(fwd.loss.dtype)
        self._collect(model, result, fwd)
        return result

    def _collect(self, model: nn.Module, result: RunResult, fwd: ForwardOut | None) -> None:
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        result.grads = grads
        checks: list[torch.Tensor] = []
        if fwd is not None and fwd.loss is not None:
            checks.append(torch.isfinite(fwd.loss.detach()).all().reshape(1).to(torch.float32))
            checks.append(fwd.loss.detach().float().reshape(1))
        elif fwd is not None and fwd.results:
            # A forward without gradients ends in its outputs: their finiteness is the step's "loss".
            checks.append(torch.stack([torch.isfinite(t).all() for t in fwd.results]).all().reshape(1).to(torch.float32))
        if grads:
            # One fused norm per gradient: finite norm <=> finite gradient (for |g| < ~1e19).
            norms = torch._foreach_norm([g.detach() for g in grads.values()])
            checks.append(torch.isfinite(torch.stack([n.to(torch.float32) for n in norms])).to(torch.float32))
        if not checks:
            return
        values = torch.cat([c.cpu() for c in checks]).tolist()  # one read-back per run
        if fwd is not None and fwd.loss is not None:
            result.loss_finite = bool(values[0])
            result.loss = float(values[1])
            values = values[2:]
        elif fwd is not None and fwd.results:
            result.loss_finite = bool(values[0])
            values = values[1:]
        suspects = [n for n, ok in zip(grads, values) if not ok]
        # A norm can overflow on huge finite values: confirm element-wise (rare path).
        result.nonfinite_grads = [n for n in suspects if not bool(torch.isfinite(grads[n]).all())]
        result.grads_finite = not result.nonfinite_grads
