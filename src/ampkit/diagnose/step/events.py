"""Turn a traced step into findings: the producer of the first non-finite value, and its kind.

The **producer** is the first op (in execution order) whose output holds a non-finite value
its inputs could not have passed on:

* all inputs finite, output ±inf          -> FORWARD_OVERFLOW (CAST_OVERFLOW for a cast,
                                             NORM_STATS_NONFINITE for a normalisation op);
* no input NaN, output NaN                -> FORWARD_NAN (0·inf, inf−inf, 0/0, or an overflow
                                             inside a fused op);
* the same in backward                    -> BACKWARD_OVERFLOW (classified against the loss
                                             scale by the caller).

The **NaN birth** (``find_producer(..., nan_only=True)``) is the first op that creates a NaN,
past any earlier overflow; ``ampkit.diagnose.step.nanorigin`` gives its cause and the inf that
fed it.  Ops that receive a non-finite Python number (``masked_fill(mask, -inf)``) produce it on
purpose and are never producers.  Everything downstream of the producer merely passes the
value on and is not reported.  Tensors entering the computation with a NaN (data, targets)
or non-finite parameters are NONFINITE_INPUT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.display import display_location, display_module, keep_fp32_fix
from ampkit.diagnose.core.stats import FORMATS, tensor_stats
from ampkit.diagnose.step.nanorigin import inf_source, nan_cause, nan_text
from ampkit.diagnose.step.trace import CAST_OPS, OpError, OpRecord, TraceLog
from ampkit.findings import Code, Finding, Severity, nonfinite_input

__all__ = [
    "Producer",
    "error_finding",
    "find_producer",
    "input_findings",
    "producer_finding",
]

_DTYPE_BITS = {"fp64": 64, "fp32": 32, "bf16": 16, "fp16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8}


@dataclass(frozen=True)
class Producer:
    record: OpRecord
    kind: str
    """``overflow`` (finite -> ±inf), ``nan`` (finite -> NaN) or ``nan_from_inf`` (±inf -> NaN)."""
    in_absmax: float
    """Largest |input| over the op's finite inputs."""
    in_dtypes: tuple[str, ...]
    out_dtype: str | None


def _short(op: str) -> str:
    return op.split("::", 1)[-1]


def find_producer(log: TraceLog, phase: str, *, nan_only: bool = False) -> Producer | None:
    """The first op of ``phase`` that creates a non-finite value (see the module docstring);
    with ``nan_only``, the first op that creates a NaN (the NaN's birth, past any earlier overflow)."""
    for rec in log.records:
        if rec.phase != phase or rec.scalar_nonfinite or not rec.out_slots:
            continue
        out_states = [log.state(s) for s in rec.out_slots]
        out_nan = any(s[0] for s in out_states)
        out_inf = any(s[1] or s[2] for s in out_states)
        if not (out_nan or out_inf) or (nan_only and not out_nan):
            continue
        in_states = [log.state(s) for s in rec.in_slots if log.slots[s].kind != "uninit"]
        if any(s[0] for s in in_states):
            continue
        in_inf = any(s[1] or s[2] for s in in_states)
        if in_inf and not out_nan:
            continue
        kind = "nan_from_inf" if in_inf else ("nan" if out_nan else "overflow")
        finite_in = [log.absmax(s) for s, st in zip(rec.in_slots, in_states) if not any(st)]
        bad_out = [d for d, st in zip(rec.out_dtypes, out_states) if any(st)]
        return Producer(record=rec, kind=kind, in_absmax=max(finite_in, default=0.0), in_dtypes=rec.in_dtypes,
                        out_dtype=bad_out[0] if bad_out else None)
    return None


def _is_cast(p: Producer) -> bool:
    if _short(p.record.op) not in CAST_OPS or p.out_dtype is None:
        return False
    widest = max((_DTYPE_BITS.get(d, 0) for d in p.in_dtypes), default=0)
    return _DTYPE_BITS.get(p.out_dtype, 0) < widest or p.out_dtype not in p.in_dtypes


def _is_norm_op(p: Producer) -> bool:
    return "norm" in _short(p.record.op)


def _fmt_max(dtype: str | None) -> str:
    name = dtype_name(dtype)
    return f" ({name} tops out at {FORMATS[name].max:g})" if name in FORMATS else ""


def producer_finding(p: Producer, *, step_nonfinite: bool, step: int | None, module_type: str | None,
                     reference_absmax: float | None, log: TraceLog | None = None,
                     fp32_nan: bool | None = None, nan_birth: bool = False) -> Finding:
    """The forward finding for a producer (see the module docstring for the code chosen).

    For a NaN, ``log`` lets the finding name the inf that fed it, and ``fp32_nan`` says whether the
    fp32 shadow produced the NaN at the same op too (then keeping a module in fp32 cannot help).
    ``nan_birth`` reports a NaN producer as FORWARD_NAN whatever its op (a normalisation op that
    turns an earlier op's inf into NaN is where the NaN is born, not a statistics overflow).
    """
    rec = p.record
    where = display_module(rec.module)
    evidence: dict[str, Any] = {
        "phase": "forward", "kind": p.kind, "input_dtypes": list(p.in_dtypes), "output_dtype": p.out_dtype,
        "input_absmax": p.in_absmax, "op_index": rec.index, "step_nonfinite": step_nonfinite,
    }
    if module_type:
        evidence["module_type"] = module_type
    if reference_absmax is not None:
        evidence["fp32_module_output_absmax"] = reference_absmax
    severity: Severity = "error" if step_nonfinite else "warning"
    code: Code
    tail = "" if step_nonfinite else " The step still ended finite (the value was masked or saturated later)."
    ref = (f" The fp32 reference reaches |x| = {reference_absmax:.4g} in this module's output."
           if reference_absmax is not None else "")
    if nan_birth:
        code, message, fix = _nan_finding_text(p, log, where, tail, fp32_nan, evidence)
    elif p.kind == "overflow" and _is_cast(p):
        code = "CAST_OVERFLOW"
        message = (f"{rec.op} in {where} cast finite values (largest |x| = {p.in_absmax:.4g}) to {dtype_name(p.out_dtype)}, "
                   f"which cannot represent them: they became ±inf{_fmt_max(p.out_dtype)}.{ref}{tail}")
        fix = keep_fp32_fix(rec.module, "Values beyond the target range must stay in fp32; for additive masks use "
                            "torch.finfo(scores.dtype).min instead of an fp32 constant.")
    elif _is_norm_op(p):
        code = "NORM_STATS_NONFINITE"
        message = (f"{rec.op} in {where} produced non-finite statistics/outputs from finite inputs "
                   f"(largest |x| = {p.in_absmax:.4g}): the variance overflowed in {dtype_name(p.out_dtype)}.{ref}{tail}")
        fix = keep_fp32_fix(rec.module, "Normalisation layers need fp32 statistics.")
    elif p.kind == "overflow":
        code = "FORWARD_OVERFLOW"
        message = (f"{rec.op} in {where} overflowed: finite {'/'.join(sorted({dtype_name(d) for d in p.in_dtypes}))} inputs "
                   f"(largest |x| = {p.in_absmax:.4g}) gave ±inf in {dtype_name(p.out_dtype)}{_fmt_max(p.out_dtype)}.{ref}{tail}")
        fix = keep_fp32_fix(rec.module, "Alternatively rescale before this op (e.g. divide attention logits "
                            "by sqrt(d) before the matmul, upcast x before x*x), or use bf16, whose range is fp32's.")
    else:
        code, message, fix = _nan_finding_text(p, log, where, tail, fp32_nan, evidence)
    return Finding(code=code, severity=severity, message=message, fix=fix, module=rec.module, op=rec.op,
                   location=display_location(rec.location), step=step, evidence=evidence)


def _nan_finding_text(p: Producer, log: TraceLog | None, where: str, tail: str, fp32_nan: bool | None,
                      evidence: dict[str, Any]) -> tuple[Code, str, str]:
    """FORWARD_NAN's code, message and fix, by cause (``ampkit.diagnose.step.nanorigin``)."""
    rec = p.record
    cause = nan_cause(log, rec) if log is not None else "other"
    source = inf_source(log, rec) if log is not None and p.kind == "nan_from_inf" else None
    what, advice = nan_text(cause, p.out_dtype, source)
    evidence["cause"] = cause
    fed = ""
    if source is not None:
        evidence["inf_source"] = source.to_json()
        fed = f"; {source.describe()}"
    if fp32_nan is not None:
        evidence["nan_in_fp32"] = fp32_nan
    also = " The fp32 reference produces the same NaN: this is not a precision problem." if fp32_nan else ""
    message = f"{rec.op} in {where} produced the step's first NaN: {what}{fed}.{also}{tail}"
    fix = advice if fp32_nan else keep_fp32_fix(rec.module, advice)
    return "FORWARD_NAN", message, fix


def input_findings(log: TraceLog, *, step: int | None) -> list[Finding]:
    """NONFINITE_INPUT for NaN in data/targets and non-finite parameters or buffers (forward)."""
    out: list[Finding] = []
    seen_params: list[str] = []
    for slot, info in enumerate(log.slots):
        if info.op_index is None or info.kind not in ("input", "parameter", "buffer"):
            continue
        rec = log.records[info.op_index]
        if rec.phase != "forward":
            continue
        nan, pinf, ninf = log.state(slot)
        if info.kind == "input" and nan:
            t = log.input_tensors.get(slot)
            evidence: dict[str, Any] = {"shape": list(info.shape), "dtype": info.dtype, "consumed_by": rec.op}
            if t is not None:
                st = tensor_stats(t)
                evidence.update(nan=st.nan, posinf=st.posinf, neginf=st.neginf)
                if t.dim() >= 1 and t.shape[0] > 0:
                    rows = torch.isnan(t.detach()).reshape(t.shape[0], -1).any(1).nonzero().flatten()
                    evidence["nan_rows"] = rows[:32].tolist()  # host read: only on the diagnosis path
            rows_txt = f" (rows {evidence['nan_rows']} of the batch)" if evidence.get("nan_rows") else ""
            message, fix = nonfinite_input(f"a {dtype_name(info.dtype)} tensor of shape {list(info.shape)} entering {rec.op} in "
                                           f"{display_module(rec.module)} already holds NaN{rows_txt}")
            out.append(Finding(
                code="NONFINITE_INPUT", severity="error", message=message, fix=fix,
                module=rec.module, op=rec.op, location=display_location(rec.location), step=step, evidence=evidence,
            ))
        elif info.kind in ("parameter", "buffer") and (nan or pinf or ninf) and info.name not in seen_params:
            seen_params.append(info.name or "")
            running = info.kind == "buffer" and "running" in (info.name or "")
            out.append(Finding(
                code="NORM_STATS_NONFINITE" if running else "NONFINITE_INPUT", severity="error",
                message=(f"{info.kind} {info.name!r} is already non-finite before this step: an earlier step "
                         "wrote inf/NaN into it"),
                fix=("Restore from the last good checkpoint; keep skip_nonfinite=True (the default) so steps with "
                     "non-finite gradients are skipped instead of applied"
                     + ("; keep the normalisation layer in fp32" if running else "")),
                module=rec.module if not running else (info.name or "").rpartition(".")[0],
                op=rec.op, location=display_location(rec.location), step=step,
                evidence={"name": info.name, "kind": info.kind, "nan": nan, "inf": pinf or ninf},
            ))
    return out


_MISMATCH_HINTS = ("dtype", "scalar type", "same type", "Half", "BFloat16", "Float", "Double")


def error_finding(err: OpError, exc: BaseException, *, step: int | None) -> Finding | None:
    """DTYPE_MISMATCH / CAST_OVERFLOW for an op that raised; None when it is neither."""
    text = str(exc)
    where = display_module(err.module)
    evidence: dict[str, Any] = {"input_dtypes": list(err.in_dtypes), "phase": err.phase, "error": text.splitlines()[0][:500]}
    if "cannot be converted to type" in text and "overflow" in text:
        return Finding(
            code="CAST_OVERFLOW", severity="error",
            message=f"{err.op} in {where} raised: {err.message}",
            fix=("A Python constant does not fit the tensor's dtype (e.g. -1e9 or torch.finfo(torch.float32).min "
                 "into fp16): use torch.finfo(t.dtype).min, or compute this part in fp32."),
            module=err.module, op=err.op, location=display_location(err.location), step=step, evidence=evidence,
        )
    mixed = len({d for d in err.in_dtypes}) > 1
    if mixed or any(h in text for h in _MISMATCH_HINTS):
        message = f"{err.op} in {where} got mixed dtypes {sorted({dtype_name(d) for d in err.in_dtypes})} and raised: {err.message}"
        fix = ("Run the op inside mp.autocast() so autocast casts both operands to one dtype, or cast explicitly "
               "(x.to(weight.dtype)); a manual .half()/.bfloat16() on one tensor or module is the usual cause.")
        stored = _stored_params_clash(err)
        if stored is not None:
            message, fix = f"{message}. {stored[0]}", stored[1]
            evidence["params"] = {n: dtype_name(d) for n, d in err.params}
        return Finding(code="DTYPE_MISMATCH", severity="error", message=message, fix=fix, module=err.module, op=err.op,
                       location=display_location(err.location), step=step, evidence={**evidence, "autocast": err.autocast})
    return None


def _stored_params_clash(err: OpError) -> tuple[str, str] | None:
    """(sentence, fix) when the op ran under autocast and its parameters' stored dtype differs from its
    other inputs': autocast casts an op's inputs only for the ops it covers, so the stored dtype is the cause."""
    others = {dtype_name(d) for d in err.in_dtypes} - {dtype_name(d) for _, d in err.params}
    if not (err.autocast and err.params and others):
        return None
    stored = sorted({dtype_name(d) for _, d in err.params})
    names = ", ".join(n for n, _ in err.params[:3])
    return (f"It ran under autocast, but the parameters it takes ({names}) are stored in {'/'.join(stored)} while its "
            f"input is {'/'.join(sorted(others))}: autocast does not cast the parameters of this op, so their stored "
            "dtype decides",
            "Keep the parameters in fp32 (drop the .half() / .bfloat16() / .to(dtype) call or the low-precision load "
            f"that made them {'/'.join(stored)}) and let autocast cast them per op.")
