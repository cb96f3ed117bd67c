"""Op-level tracing of one forward + backward, every aten op attributed to its module.

``OpTracer`` is a ``TorchDispatchMode``: it sees each aten op after autocast has chosen its
dtype (so autocast's own casts appear as ``aten::_to_copy``), in forward and in backward.
For every op it records the op name, the module running it, the user's ``file:line``, the
input and output dtypes, and one ``aminmax`` reduction per output (a single pass that tells
NaN, +Inf, −Inf and the range apart; it stays on the device).  Outputs of shape-only views
(``view``, ``t``, ``expand`` ...) share their input's reduction instead of paying for one.

Attribution:

* forward: the innermost module whose forward is running (``ModuleRecorder.current``);
* backward: ``torch._C._current_autograd_node()`` names the autograd node being evaluated;
  each node is mapped, when the forward op that created it returns, to that forward op, so
  backward ops carry the module and the user line of the forward op they differentiate
  (``AccumulateGrad`` nodes map to the module owning the parameter);
* location: the innermost Python frame that is user code (``ampkit._util.frames.UserFrames``); a
  replay of a captured step (``stop``) looks only above its own frame, and an op no user frame
  runs there (a built-in module's) takes ``call_site``, the user's line that called the model.

Cost: a Python call, a pytree flatten, a short stack walk and one reduction per op. It only
runs on a step being diagnosed, never in the training hot path.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ampkit._util.dtypes import dtype_name
from ampkit._util.frames import UserFrames
from ampkit.diagnose.core.modules import ModuleRecorder

__all__ = ["CAST_OPS", "OpError", "OpRecord", "OpTracer", "SlotInfo", "TraceLog"]

# Outputs that hold exactly the input's elements (possibly repeated): they share its reduction
# (only when the dtype is unchanged, so a casting ``_to_copy`` is always reduced).
_SHAPE_ONLY = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "expand_as", "unsqueeze", "squeeze", "detach", "alias", "lift_fresh", "view_as", "flatten",
    "unflatten", "movedim", "numpy_T", "clone", "_to_copy",
})
# Ops whose output memory is uninitialised: reducing it would read garbage (and false NaNs).
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_permuted"})
CAST_OPS = frozenset({"_to_copy", "copy_", "to", "_copy_from", "_copy_from_and_resize", "copy"})


@dataclass(slots=True)
class SlotInfo:
    """Where one reduced tensor came from."""

    kind: str
    """``op`` (an op output), ``input`` (entered the computation from outside: data, targets,
    masks), ``parameter``, ``buffer``, ``saved`` (first seen in backward) or ``uninit``."""
    op_index: int | None = None
    """The op that produced it, or the first op that consumed it (for ``input`` and ``parameter``)."""
    name: str | None = None
    """Parameter or buffer name."""
    dtype: str = ""
    """As ``dtype_name`` spells it (``fp16``): the spelling of the findings' evidence."""
    shape: tuple[int, ...] = ()


@dataclass(slots=True)
class OpRecord:
    """One traced aten op."""

    index: int
    phase: str
    """``forward`` or ``backward``."""
    op: str
    """``aten::mm``."""
    module: str | None
    location: str | None
    in_dtypes: tuple[str, ...]
    """Each tensor input's dtype as ``dtype_name`` spells it (``fp16``, ``fp32``, ``int64``)."""
    out_dtypes: tuple[str, ...]
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    scalar_nonfinite: bool = False
    """A Python-number argument is ±inf/NaN (``masked_fill(mask, -inf)``): non-finite on purpose."""
    forward_op: int | None = None
    """For backward ops: the forward op that created the autograd node being evaluated."""
    node: str | None = None
    """For backward ops: the autograd node's name (``AddmmBackward0``)."""


@dataclass
class OpError:
    """An op that raised (a dtype mismatch, a cast that cannot represent a value ...)."""

    op: str
    module: str | None
    location: str | None
    in_dtypes: tuple[str, ...]
    phase: str
    message: str
    params: tuple[tuple[str, str], ...] = ()
    """(name, dtype) of the model's parameters among the op's inputs."""
    autocast: bool = False
    """Autocast was on for the inputs' device when the op ran."""


def _short(func: Any) -> tuple[str, str]:
    name = func._schema.name  # "aten::mm"
    return name, name.split("::", 1)[-1]


def _mutated_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments the op writes in place (``add_``'s self, batch_norm's running stats)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            out.append(value)
    return out


def _min_max(t: torch.Tensor) -> torch.Tensor:
    """[min, max] of ``t`` as float32 on its device (one pass); zeros when it cannot be reduced.

    ``aminmax`` is exact in the tensor's own dtype and propagates NaN.  Layouts and dtypes it
    does not support (sparse, fp8 on some backends) are reduced through their values or an fp32
    copy; a tensor that still cannot be reduced counts as finite rather than breaking the op.
    """
    x = t.detach()
    if x.layout != torch.strided:
        x = x.coalesce()._values() if x.is_sparse else x.to_dense()
    for widen in (False, True):
        try:
            mn, mx = torch.aminmax(x.float() if widen else x)
            return torch.stack([mn, mx]).to(torch.float32)
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    return torch.zeros(2, dtype=torch.float32, device=t.device)


class OpTracer(TorchDispatchMode):
    """Record every aten op of a forward + backward (see the module docstring).

    Use ``with ModuleRecorder(model) as rec, OpTracer(model, rec):``; set ``phase`` to
    ``"backward"`` before calling backward; call ``finalize()`` afterwards to read every
    reduction back in one transfer.
    """

    def __init__(self, model: nn.Module, recorder: ModuleRecorder, *, user_frames: UserFrames,
                 stop: types.FrameType | None = None, call_site: str | None = None) -> None:
        super().__init__()
        self.recorder = recorder
        self.frames = user_frames
        self.stop = stop
        """The frame that runs the traced computation: user frames below it are not an op's place."""
        self.call_site = call_site
        """An op's location when no user frame runs it above ``stop`` (a built-in module's op)."""
        self.phase = "forward"
        self.records: list[OpRecord] = []
        self.slots: list[SlotInfo] = []
        self.error: OpError | None = None
        self._pending_vals: list[torch.Tensor] = []
        self.values: list[tuple[float, float]] = []
        """Per slot: (min, max) over the tensor, after ``finalize``; NaN when it holds a NaN."""
        self._slot_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._params = {id(p): n for n, p in model.named_parameters()}
        self._buffers = {id(b): n for n, b in model.named_buffers()}
        self._param_module = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
        self._node_op: dict[Any, int] = {}
        self._pending_nodes: list[tuple[torch.Tensor, int]] = []
        self.input_tensors: dict[int, torch.Tensor] = {}
        """Strong references to the tensors of ``input`` slots (few: data, targets, masks)."""

    # -- slots -------------------------------------------------------------------------------
    def _new_slot(self, t: torch.Tensor, info: SlotInfo) -> int:
        info.dtype = dtype_name(t.dtype)
        info.shape = tuple(t.shape)
        self.slots.append(info)
        if t.numel() == 0 or info.kind == "uninit":
            v = torch.zeros(2, dtype=torch.float32, device=t.device)
        else:
            v = _min_max(t)
        self._pending_vals.append(v)
        return len(self.slots) - 1

    def _input_slot(self, t: torch.Tensor, op_index: int) -> int:
        slot = self._slot_of.get(t)
        if slot is not None:
            return int(slot)
        if id(t) in self._params:
            info = SlotInfo(kind="parameter", op_index=op_index, name=self._params[id(t)])
        elif id(t) in self._buffers:
            info = SlotInfo(kind="buffer", op_index=op_index, name=self._buffers[id(t)])
        else:
            info = SlotInfo(kind="input" if self.phase == "forward" else "saved", op_index=op_index)
        slot = self._new_slot(t, info)
        self._slot_of[t] = slot
        if info.kind == "input":
            self.input_tensors[slot] = t
        return slot

    def slot_of(self, t: torch.Tensor) -> int | None:
        """The slot of a tensor seen by the tracer (before ``finalize``), else None."""
        slot = self._slot_of.get(t)
        return None if slot is None else int(slot)

    # -- autograd node attribution ---------------------------------------------------------
    def _resolve_nodes(self) -> None:
        for t, index in self._pending_nodes:
            node = t.grad_fn
            if node is not None and node not in self._node_op:
                self._node_op[node] = index
        self._pending_nodes.clear()

    def end_forward(self) -> None:
        """Call between forward and backward: maps the last op's autograd node."""
        self._resolve_nodes()
        self.phase = "backward"

    def _backward_origin(self) -> tuple[int | None, str | None, str | None, str | None]:
        node = torch._C._current_autograd_node()
        if node is None:
            return None, None, None, None
        node_name = type(node).__name__
        fwd = self._node_op.get(node)
        if fwd is not None:
            rec = self.records[fwd]
            return fwd, rec.module, rec.location, node_name
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter it accumulates into
        if variable is not None and id(variable) in self._param_module:
            return None, self._param_module[id(variable)], None, node_name
        return None, None, None, node_name

    # -- the dispatch hook -----------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._pending_nodes:
            self._resolve_nodes()
        index = len(self.records)
        name, short = _short(func)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()]
        scalar_nonfinite = any(isinstance(a, float) and not math.isfinite(a) for a in leaves)
        if self.phase == "forward":
            module, fwd, node_name = self.recorder.current, None, None
            location = self.frames.location(2, stop=self.stop) or self.call_site
        else:
            fwd, module, location, node_name = self._backward_origin()
        in_slots = tuple(self._input_slot(t, index) for t in tensors)
        in_dtypes = tuple(dtype_name(t.dtype) for t in tensors)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            params = tuple((self.slots[s].name or "", d) for s, d in zip(in_slots, in_dtypes)
                           if self.slots[s].kind == "parameter")
            self.error = OpError(op=name, module=module, location=location, in_dtypes=in_dtypes,
                                 phase=self.phase, message=str(exc).strip().splitlines()[0] if str(exc) else "",
                                 params=params, autocast=self.recorder.autocast)
            raise
        out_leaves, _ = tree_flatten(out)
        outs = [o for o in out_leaves if isinstance(o, torch.Tensor) and o.is_floating_point()]
        mutated = [m for m in _mutated_args(func, args, kwargs) if all(m is not o for o in outs)]
        out_slots: list[int] = []
        for o in outs + mutated:
            if short in _SHAPE_ONLY and in_slots and o.numel() and tensors and o.dtype == tensors[0].dtype:
                slot = in_slots[0]
            else:
                kind = "uninit" if short in _UNINITIALISED else "op"
                slot = self._new_slot(o, SlotInfo(kind=kind, op_index=index))
            self._slot_of[o] = slot
            out_slots.append(slot)
        self.records.append(OpRecord(
            index=index, phase=self.phase, op=name, module=module, location=location, in_dtypes=in_dtypes,
            out_dtypes=tuple(dtype_name(o.dtype) for o in outs + mutated),
            in_slots=in_slots, out_slots=tuple(out_slots), scalar_nonfinite=scalar_nonfinite,
            forward_op=fwd, node=node_name,
        ))
        if self.phase == "forward" and outs:
            self._pending_nodes = [(o, index) for o in outs]
        return out

    def finalize(self) -> None:
        """Read every reduction back to the host: one transfer (a host sync, once per traced step)."""
        self._resolve_nodes()
        if self._pending_vals:
            by_device: dict[torch.device, list[int]] = {}
            for i, v in enumerate(self._pending_vals):
                by_device.setdefault(v.device, []).append(i)
            values: list[tuple[float, float]] = [(0.0, 0.0)] * len(self._pending_vals)
            for idxs in by_device.values():
                rows = torch.stack([self._pending_vals[i] for i in idxs]).cpu().tolist()
                for i, row in zip(idxs, rows):
                    values[i] = (float(row[0]), float(row[1]))
            self.values = values
        self._pending_vals = []
        self._node_op.clear()
        self._slot_of = WeakIdKeyDictionary()


@dataclass
class TraceLog:
    """The records of one traced run, ready for ``ampkit.diagnose.step.events``."""

    records: list[OpRecord]
    slots: list[SlotInfo]
    values: list[tuple[float, float]]
    error: OpError | None = None
    input_tensors: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_tracer(cls, tracer: OpTracer) -> TraceLog:
        return cls(records=tracer.records, slots=tracer.slots, values=tracer.values, error=tracer.error,
                   input_tensors=tracer.input_tensors)

    def state(self, slot: int) -> tuple[bool, bool, bool]:
        """(has NaN, has +Inf, has −Inf); a NaN hides whether infinities are present too."""
        mn, mx = self.values[slot]
        if math.isnan(mn) or math.isnan(mx):
            return True, False, False
        return False, mx == math.inf, mn == -math.inf

    def absmax(self, slot: int) -> float:
        mn, mx = self.values[slot]
        return max(abs(mn), abs(mx))
