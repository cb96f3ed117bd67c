"""Compiled vs eager, module by module: where ``torch.compile`` changes a step's numerics.

``torch.compile`` (inductor) fuses chains of element-wise ops and keeps their intermediates in
fp32, where eager rounds every op's result to fp16/bf16; it also reorders reductions.  Usually
the difference is a rounding or two.  Sometimes it is the whole signal: ``(a + b) - a`` with a
large ``a`` is 0 in eager fp16 and ``b`` when compiled.  This module finds such places:

1. Record, in one eager forward and backward of the captured step (a copy of the model, the
   captured batch, RNG and autocast state, and the gradient the outputs received), every
   module's inputs and the gradient that reached its outputs.
2. Compare a module: run it eagerly and compiled (``torch.compile`` with the script's options,
   inductor by default) on those inputs, with the same weights (two copies), and compare the
   outputs and the gradients of its inputs and parameters (``torch.autograd.grad`` with the
   recorded output gradient).  Random ops draw the same numbers in both
   (``torch._inductor.config.fallback_random``).
3. Descend: start with the whole model; for a module that differs beyond its dtype's
   tolerance, compare its children (through containers that are never called).  The modules
   reported are those that differ while none of their compared descendants does: the innermost
   place the difference is born, with each module fed eager inputs, so a difference upstream is
   never counted downstream.

Tolerance: the SQNR of compiled against eager (the reference) must reach ``tolerance_db(dtype)``,
the SQNR of one rounding to the dtype (``6.02 p + 4.77`` dB for ``p`` significand bits) less a
24 dB margin (16x the rounding noise): 47.0 dB for fp16, 28.9 dB for bf16, 125.2 dB for fp32.
The dtype is the step's low-precision dtype (autocast or half parameters), fp32 otherwise.

Cost: one compile per compared module (seconds each with inductor on CPU) and one recorded
forward's activations held in memory.  Dynamo's caches are reset before each compile (a new
module instance of an already compiled class would otherwise count towards its recompile
limit) and after the comparison, so nothing carries over to later compiles in the process.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.modules import float_tensors
from ampkit.diagnose.step.compare import sqnr_db
from ampkit.diagnose.step.session import copy_model

__all__ = [
    "COMPILE_HOOK_WARNING", "CompiledComparison", "ModuleDelta", "TensorDelta", "compare_compiled", "tensor_delta",
    "tolerance_db",
]

COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
"""torch warns when it compiles a module while global module hooks exist.  Observers' hooks are
no-ops inside compiled code, and torch (2.13) leaves a with_kwargs global hook's flag behind after
the hook is removed, so the warning would fire for every later compile in the process."""
TOLERANCE_MARGIN_DB = 24.0
"""How far below one rounding's SQNR a module may fall before it is said to differ (16x the noise)."""
_SIGNIFICAND_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def tolerance_db(dtype: torch.dtype) -> float:
    """The SQNR (dB) compiled must keep against eager for a step computed in ``dtype``.

    >>> [round(tolerance_db(d), 1) for d in (torch.float16, torch.bfloat16, torch.float32)]
    [47.0, 28.9, 125.2]
    """
    bits = _SIGNIFICAND_BITS.get(dtype, 24)
    return 6.02 * bits + 4.77 - TOLERANCE_MARGIN_DB


@dataclass
class TensorDelta:
    """How one compiled tensor differs from its eager twin."""

    what: str
    """``output``, ``output #1``, ``grad of input #0``, ``grad of weight``, ..."""
    sqnr_db: float
    """SQNR of compiled against eager over the finite elements; ``-inf`` when their inf/NaN differ."""
    max_abs_diff: float
    max_rel_diff: float
    """The largest absolute difference over the largest eager magnitude."""
    nonfinite: str | None = None
    """Where inf/NaN appear that the other run does not have: ``compiled``, ``eager`` or ``both``."""

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "sqnr_db": self.sqnr_db, "max_abs_diff": self.max_abs_diff,
                "max_rel_diff": self.max_rel_diff, "nonfinite": self.nonfinite}


def tensor_delta(what: str, eager: torch.Tensor, compiled: torch.Tensor) -> TensorDelta:
    """Compare two tensors in float64 (a host read).

    >>> a = torch.tensor([1.0, 2.0, float("inf")])
    >>> d = tensor_delta("output", a, torch.tensor([1.0, 2.5, float("inf")]))
    >>> round(d.sqnr_db, 1), d.max_abs_diff, d.max_rel_diff
    (13.0, 0.5, 0.25)
    """
    if eager.shape != compiled.shape:
        return TensorDelta(what, -math.inf, math.inf, math.inf)
    e, c = eager.detach().double(), compiled.detach().double()
    finite = torch.isfinite(e) & torch.isfinite(c)
    same = (e == c) | (torch.isnan(e) & torch.isnan(c))
    if bool((~finite & ~same).any()):
        compiled_only = bool((torch.isfinite(e) & ~torch.isfinite(c)).any())
        eager_only = bool((torch.isfinite(c) & ~torch.isfinite(e)).any())
        side = "both" if compiled_only and eager_only else "compiled" if compiled_only else "eager"
        return TensorDelta(what, -math.inf, math.inf, math.inf, side)
    e, c = e[finite], c[finite]
    if e.numel() == 0:
        return TensorDelta(what, math.inf, 0.0, 0.0)
    diff = (c - e).abs()
    signal, noise = float(e.square().sum()), float(diff.square().sum())
    db = sqnr_db(signal, noise)
    scale, worst = float(e.abs().max()), float(diff.max())
    rel = worst / scale if scale > 0 else (math.inf if worst > 0 else 0.0)
    return TensorDelta(what, -math.inf if math.isnan(db) else db, worst, rel)


@dataclass
class ModuleDelta:
    """One module compared compiled vs eager."""

    module: str
    """Dotted name (``model.named_modules()``; ``""`` is the model itself)."""
    dtype: torch.dtype
    tensors: list[TensorDelta] = field(default_factory=list)
    error: str | None = None
    """Why the module could not be compiled or run (then it is not judged)."""
    reported: bool = False
    """It differs and none of its compared descendants does."""

    @property
    def tolerance_db(self) -> float:
        return tolerance_db(self.dtype)

    @property
    def worst(self) -> TensorDelta | None:
        return min(self.tensors, key=lambda t: t.sqnr_db, default=None)

    @property
    def diverges(self) -> bool:
        worst = self.worst
        return worst is not None and worst.sqnr_db < self.tolerance_db

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {"module": self.module, "dtype": dtype_name(self.dtype), "tolerance_db": round(self.tolerance_db, 2),
                "sqnr_db": worst.sqnr_db if worst else None, "max_abs_diff": worst.max_abs_diff if worst else None,
                "max_rel_diff": worst.max_rel_diff if worst else None, "worst": worst.what if worst else None,
                "diverges": self.diverges, "reported": self.reported, "error": self.error,
                "tensors": [t.to_dict() for t in self.tensors]}


@dataclass
class CompiledComparison:
    """The modules compared, in the order they were, and what could not be."""

    modules: list[ModuleDelta]
    options: dict[str, Any]
    """The ``torch.compile`` keyword arguments used."""
    not_compared: list[str] = field(default_factory=list)
    """Modules left out because ``max_compiles`` was reached."""

    def culprits(self) -> list[ModuleDelta]:
        return [m for m in self.modules if m.reported]

    def to_dict(self) -> dict[str, Any]:
        return {"options": {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                            for k, v in self.options.items()},
                "compiles": len(self.modules), "modules": [m.to_dict() for m in self.modules],
                "culprits": [m.module for m in self.culprits()], "not_compared": self.not_compared}


@dataclass
class _Call:
    args: Any
    kwargs: Any
    grads: list[torch.Tensor | None] = field(default_factory=list)
    """Gradient that reached each floating output requiring grad, in ``tree_flatten`` order."""
    seen: bool = False


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad and x.is_floating_point())
    return x


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [x for x in float_tensors(out) if x.requires_grad]


def _record(model: nn.Module, args: Any, kwargs: Any, autocast: Callable[[], Any],
            grads: list[torch.Tensor | None]) -> dict[str, _Call]:
    """Every module's inputs (first call) and output gradients in one eager forward and backward."""
    calls: dict[str, _Call] = {}
    names = {id(m): n for n, m in model.named_modules()}

    def pre(mod: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        if names[id(mod)] not in calls:  # a shared module: its first call stands for it
            calls[names[id(mod)]] = _Call(tree_map(_leaf, a), tree_map(_leaf, kw))

    def post(mod: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], out: Any) -> None:
        call = calls[names[id(mod)]]
        if call.seen:
            return
        call.seen = True
        for i, o in enumerate(_grad_outputs(out)):
            call.grads.append(None)
            o.register_hook(lambda g, i=i, call=call: call.grads.__setitem__(i, g.detach()))

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                                     m.register_forward_hook(post, with_kwargs=True))]
    try:
        with autocast():
            outs = _grad_outputs(model(*tree_map(_leaf, args), **tree_map(_leaf, kwargs)))
        pairs = [(o, g.to(o.dtype) if g is not None else torch.randn_like(o)) for o, g in
                 zip(outs, grads + [None] * (len(outs) - len(grads)))]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    finally:
        for h in handles:
            h.remove()
    return calls


def _run(module: Callable[..., Any], params: nn.Module, call: _Call,
         autocast: Callable[[], Any]) -> list[tuple[str, torch.Tensor]]:
    """Outputs, then gradients of the inputs and of ``params``' parameters, labelled."""
    args, kwargs = tree_map(_leaf, call.args), tree_map(_leaf, call.kwargs)
    torch.manual_seed(0)
    with autocast():
        out = module(*args, **kwargs)
    got = [("output" if i == 0 else f"output #{i}", x.detach()) for i, x in enumerate(float_tensors(out))]
    pairs = [(o, g) for o, g in zip(_grad_outputs(out), call.grads) if g is not None]
    inputs = [(f"grad of input #{i}", x) for i, x in enumerate(tree_flatten((args, kwargs))[0])
              if isinstance(x, torch.Tensor) and x.requires_grad]
    wrt = inputs + [(f"grad of {n}", p) for n, p in params.named_parameters() if p.requires_grad]
    if pairs and wrt:
        grads = torch.autograd.grad([o for o, _ in pairs], [t for _, t in wrt], [g for _, g in pairs],
                                    allow_unused=True)
        got += [(label, g) for (label, _), g in zip(wrt, grads) if g is not None]
    return got


def _compare_one(name: str, module: nn.Module, call: _Call, autocast: Callable[[], Any], dtype: torch.dtype,
                 options: dict[str, Any]) -> ModuleDelta:
    delta = ModuleDelta(name, dtype)
    eager_mod, compiled_mod = copy_model(module), copy_model(module)
    try:
        eager = _run(eager_mod, eager_mod, call, autocast)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fallback_random=True):
            compiled = _run(torch.compile(compiled_mod, **options), compiled_mod, call, autocast)
    except Exception as exc:  # an uncompilable module is reported as such, never fatal
        delta.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return delta
    mine = dict(compiled)
    delta.tensors = [tensor_delta(label, t, mine[label]) if label in mine else TensorDelta(label, -math.inf,
                                                                                              math.inf, math.inf)
                     for label, t in eager]
    return delta


def _called_children(model: nn.Module, name: str, calls: dict[str, _Call]) -> Iterator[str]:
    """The nearest called descendants of ``name``: containers that are never called are looked through."""
    for child, _ in model.get_submodule(name).named_children():
        full = f"{name}.{child}" if name else child
        if full in calls:
            yield full
        else:
            yield from _called_children(model, full, calls)


def _below(child: str, parent: str) -> bool:
    return child != parent and (parent == "" or child.startswith(parent + "."))


def compare_compiled(model: nn.Module, args: Any, kwargs: Any, *, autocast: Callable[[], Any], dtype: torch.dtype,
                     grads: list[torch.Tensor | None], options: dict[str, Any] | None = None,
                     rng_cpu: torch.Tensor | None = None, max_compiles: int = 32) -> CompiledComparison:
    """Compare ``torch.compile`` against eager module by module on one step (see the module docstring).

    ``model`` is left untouched (copies run); ``autocast()`` returns the step's autocast context;
    ``grads`` are the gradients the model's floating outputs received (``None``: random ones);
    ``rng_cpu`` is the CPU RNG state the step's forward started from.  The process's RNG state is
    restored afterwards.
    """
    opts = {k: v for k, v in (options or {}).items() if k in ("backend", "mode", "dynamic", "options")}
    result = CompiledComparison([], opts)
    torch._dynamo.reset()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=COMPILE_HOOK_WARNING)
            if rng_cpu is not None:
                torch.set_rng_state(rng_cpu)
            calls = _record(copy_model(model), args, kwargs, autocast, list(grads))
            queue = [""] if "" in calls else []
            while queue:
                name = queue.pop(0)
                if len(result.modules) >= max_compiles:
                    result.not_compared.append(name)
                    continue
                delta = _compare_one(name, model.get_submodule(name), calls[name], autocast, dtype, opts)
                result.modules.append(delta)
                if delta.diverges:
                    queue.extend(_called_children(model, name, calls))
    finally:
        torch._dynamo.reset()
    for m in result.modules:
        m.reported = m.diverges and not any(o.diverges and _below(o.module, m.module) for o in result.modules)
    return result
