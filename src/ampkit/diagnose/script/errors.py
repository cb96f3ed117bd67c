"""Explain the exceptions mixed precision makes training scripts raise, with the user's line.

Each known message becomes a ``Finding``: its code, what the message means in AMP terms, the
user's ``file:line`` (innermost user frame of the traceback), the source text of that line,
the module whose forward was running (innermost frame whose ``self`` is a known module), where
in training it happened (which forward or step, and the user's call chain: ``script.where``),
and the fix.  GradScaler's step-order assertions are explained by ``script.order``.

>>> import re
>>> bool(_DTYPE_PATTERNS[0].search("mat1 and mat2 must have the same dtype, but got Half and Float"))
True
"""

from __future__ import annotations

import linecache
import re
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from ampkit._util.autograd import backward_roots, failing_node
from ampkit._util.dtypes import dtype_name
from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.order import explain_order
from ampkit.diagnose.script.where import Where, where_raised
from ampkit.findings import Code, Finding
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["exception_finding", "explain_exception"]

_CAST = re.compile(r"value cannot be converted to type (?:at::|c10::)?(\w+) without overflow")
_NORM_PARAMS = re.compile(r"mixed dtype \(CPU\): expect parameter to have scalar type of (\w+)")
_DTYPE_PATTERNS = [
    re.compile(r"mat1 and mat2 must have the same dtype, but got (\w+) and (\w+)"),
    re.compile(r"expected m1 and m2 to have the same dtype, but got: ([\w:]+) != ([\w:]+)"),
    re.compile(r"expected (?:mat1 and mat2|both vectors|self and mat2) to have the same dtype, but got: ([\w:]+) != "
               r"([\w:]+)"),
    re.compile(r"expected scalar type (\w+) but found (\w+)"),
    re.compile(r"Input type \(([\w:]+)\) and (?:weight|bias) type \(([\w:]+)\) should be the same"),
    re.compile(r"Index put requires the source and destination dtypes match, got (\w+) for the destination and "
               r"(\w+) for the source"),
    re.compile(r"query\.dtype: ([\w:]+) key\.dtype: ([\w:]+)"),
    re.compile(r"RNN input dtype \(([\w.]+)\) does not match weight dtype \(([\w.]+)\)"),
    re.compile(r"result type (\w+) can't be cast to the desired output type (\w+)"),
]


def _module_of(tb: types.TracebackType | None, names: dict[int, str]) -> str | None:
    found = None
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, nn.Module) and id(me) in names:
            found = names[id(me)]
        tb = tb.tb_next
    return found


def _source_line(location: str | None) -> str | None:
    if not location:
        return None
    path, _, line = location.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return text or None


def explain_exception(exc: BaseException, code: UserFrames, names: dict[int, str], *,
                      step: int | None = None, models: ModelWatch | None = None) -> Finding | None:
    """A finding for ``exc`` when it is one of the errors mixed precision causes, else None.

    ``step``: the optimizer step in progress when it raised, counted from 1 (the message says "after
    ``step - 1`` optimizer steps").  ``models`` (the script's model watcher) tells which forward raised:
    training, eval or no-grad.
    """
    text = str(exc)
    tb = exc.__traceback__
    for rule in _RULES:
        made = rule(text)
        if made is not None:
            code_name, message, fix, *extra = made
            evidence = extra[0] if extra else None
            if code_name == "DTYPE_MISMATCH" and (node := _backward_node(exc, text)) is not None:
                message, fix, found = node
                evidence = {**(evidence or {}), **found}
            return exception_finding(exc, code_name, message, fix, location=code.traceback_location(tb),
                                     module=_module_of(tb, names), step=step,
                                     where=where_raised(tb, code, models, None if step is None else step - 1),
                                     evidence=evidence)
    return None


_OP_WORD = re.compile(r"(?<!^)(?=[A-Z])")


def _backward_node(exc: BaseException, text: str) -> tuple[str, str, dict[str, Any]] | None:
    """DTYPE_MISMATCH's message, fix and evidence when the error came from a backward node
    (``ampkit._util.autograd.failing_node``): the op whose saved operands mix dtypes, named."""
    hit = failing_node(backward_roots(exc), text)
    if hit is None:
        return None
    node, saved = hit
    kind = type(node).__name__
    op = _OP_WORD.sub("_", re.sub(r"Backward\d*$", "", kind)).lower()
    shown = {("input" if k == "self" else k): dtype_name(d) for k, d in saved.items()}  # torch calls it self
    operands = ", ".join(f"its {name} {dtype}" for name, dtype in shown.items())
    narrow = [name for name, d in zip(shown, saved.values()) if d in LOW_PRECISION_DTYPES]
    wide = sorted({shown[name] for name, d in zip(shown, saved.values()) if d not in LOW_PRECISION_DTYPES})
    message = (f"the backward of {op} ({kind}) received mixed dtypes ({operands}): its forward accepted the "
               "mixed pair and promoted it, its backward does not; the low-precision operand came from outside "
               "autocast's casting (computed in a `torch.autocast` block and used after it, or stored as fp16/bf16); "
               "raised in the backward called")
    fix = (f"cast {op}'s {' and '.join(narrow)} to {wide[0] if wide else 'fp32'} before the call (`x.float()`), or "
           f"call {op} inside the autocast region so that autocast casts its operands alike")
    return message, fix, {"backward_node": kind, "op": op, "saved_dtypes": shown}


def exception_finding(exc: BaseException, code: Code, message: str, fix: str, *, location: str | None,
                      module: str | None, step: int | None, where: Where,
                      evidence: dict[str, Any] | None = None) -> Finding:
    """The finding of an explained exception: the explanation, then the user's line and source text,
    then where in training it happened (``script.where``), the same in the evidence."""
    text = str(exc)
    made: dict[str, Any] = {"exception": f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"}
    source = _source_line(location)
    if source:
        made["source"] = source
    made.update(evidence or {})
    made.update(where.evidence())
    at = f" at {location}" + (f" (`{source}`)" if source else "") if location else ""
    return Finding(code=code, severity="error", message=message + at + where.sentence(), fix=fix, module=module,
                   location=location, step=step, evidence=made)


def _cast_overflow(text: str) -> tuple[str, str, str] | None:
    m = _CAST.search(text)
    if not m:
        return None
    dtype = dtype_name(m.group(1).strip())
    limit = {"fp16": "65504", "bf16": "3.39e38"}.get(dtype, "its range")
    return (
        "CAST_OVERFLOW",
        f"a Python number was written into a {dtype} tensor but does not fit it (largest finite {dtype}: {limit}); "
        "typically masked_fill(mask, -1e9) or a fill constant on a tensor that autocast made low precision",
        "use a constant that fits the tensor's dtype, e.g. `scores.masked_fill(mask, torch.finfo(scores.dtype).min)`, "
        "or run this op in fp32 (`scores.float().masked_fill(...)`)",
    )


def _dtype_mismatch(text: str) -> tuple[str, str, str] | None:
    for pat in _DTYPE_PATTERNS:
        m = pat.search(text)
        if m:
            return _mismatch(dtype_name(m.group(1).strip()), dtype_name(m.group(2).strip()))
    return None


_DTYPE_WORD = re.compile(r"(?<![\w:])(?:c10::|at::|torch\.)?"
                         r"(Half|BFloat16|Float|Double|float16|bfloat16|float32|float64|half|float|double)"
                         r"(?:Tensor)?(?!\w)")  # legacy type names too: torch.HalfTensor
_FLOAT_NAMES = frozenset({"fp16", "bf16", "fp32", "fp64"})


def _dtype_pair(text: str) -> tuple[str, str, str] | None:
    """Any other error whose first line speaks of types and names two different floating dtypes, one
    of them fp16 or bf16: a dtype conflict, whatever the op's wording.  Kernels word it their own way
    (``Found dtype Half but expected Float`` from a loss's backward); the known wordings above come first.

    >>> _dtype_pair("Found dtype Half but expected Float")[0]
    'DTYPE_MISMATCH'
    >>> _dtype_pair("expected scalar type Long but found Float") is None  # an index dtype, not precision
    True
    """
    first = text.splitlines()[0] if text else ""
    if "type" not in first.lower():
        return None
    names: list[str] = []
    for m in _DTYPE_WORD.finditer(first):
        name = dtype_name(m.group(1))
        if name in _FLOAT_NAMES and name not in names:
            names.append(name)
    if len(names) != 2 or not {"fp16", "bf16"} & set(names):
        return None
    return _mismatch(names[0], names[1])


def _article(name: str) -> str:
    """``an fp16``, ``a bf16``: the article as the short name is spoken."""
    return "an" if name.startswith(("fp", "int", "uint")) else "a"


def _mismatch(a: str, b: str) -> tuple[str, str, str]:
    return (
        "DTYPE_MISMATCH",
        f"an op received {_article(a)} {a} and {_article(b)} {b} tensor: mixed precision handed it low-precision values outside "
        "autocast's casting (an op after the `with torch.autocast` block, a module converted with .half(), "
        "or an op autocast does not cover)",
        "run the op inside the same `torch.autocast` region as the code producing its inputs, or cast "
        "explicitly (`x.float()` / `x.to(weight.dtype)`); keep the model's parameters fp32 and let autocast "
        "choose the dtypes instead of calling .half() on part of it",
    )


def _norm_param_dtype(text: str) -> tuple[str, str, str] | None:
    m = _NORM_PARAMS.search(text)
    if not m:
        return None
    want = dtype_name(m.group(1))
    return (
        "DTYPE_MISMATCH",
        f"a normalisation op (layer_norm / group_norm / batch_norm on CPU) got parameters in another dtype than its "
        f"input (it accepts parameters in {want} or in the input's dtype): the module's parameters were converted to "
        "low precision (.half(), .to(torch.float16), a low-precision load) while autocast hands it another dtype",
        "keep the model's parameters fp32 and let autocast choose the dtypes (autocast runs normalisation in fp32); "
        "or cast the input to the parameters' dtype (`x.to(norm.weight.dtype)`)",
    )


def _fp16_grads(text: str) -> tuple[str, str, str] | None:
    if "Attempting to unscale FP16 gradients" not in text:
        return None
    return (
        "LOW_PRECISION_PARAMS",
        "GradScaler refused to unscale fp16 gradients: the model's parameters are fp16 (model.half() or "
        ".to(torch.float16)), but loss scaling needs fp32 master weights to unscale and update into",
        "keep the parameters in fp32 (remove .half()) and run the forward under "
        "`torch.autocast(device_type, dtype=torch.float16)`, which casts per op",
    )


def _scaler_order(text: str) -> tuple[str, str, str, dict[str, Any]] | None:
    # Raised outside the GradScaler watcher (which explains its own calls with the scaler's state):
    # the message alone picks the rule.
    rule = explain_order(text)
    if rule is None:
        return None
    return ("UNSCALE_ORDER_ERROR", rule.message(text), rule.fix, rule.evidence())


def _nonfinite_probs(text: str) -> tuple[str, str, str] | None:
    if "probability tensor contains either `inf`, `nan` or element < 0" not in text:
        return None
    return (
        "FORWARD_NAN",
        "sampling received non-finite probabilities: the logits (or their softmax) went inf/NaN in low precision",
        "compute the logits' softmax in fp32 (`logits.float().softmax(-1)`) and check the forward with "
        "`ampkit doctor` for the op that overflowed",
    )


# Each rule returns (code, message, fix) or (code, message, fix, evidence).
_RULES: list[Callable[[str], tuple[Any, ...] | None]] = [
    _cast_overflow, _dtype_mismatch, _norm_param_dtype, _fp16_grads, _scaler_order, _nonfinite_probs, _dtype_pair,
]
