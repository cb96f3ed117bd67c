"""Per-module forward hooks: which module is running, and what each module produced.

``ModuleRecorder`` registers a forward pre-hook and a forward hook on every sub-module of a
model (the doctor's private deep copy, never the user's model).  It keeps

* the module stack, so the op tracer can attribute every aten op to the innermost module
  running it (``current``);
* the on-device range (largest / smallest non-zero finite magnitude) of each module's
  floating outputs (``out_ranges``), the basis of the per-module headroom;
* optionally the outputs themselves (the fp32 shadow keeps them: memory = every module
  output of one step, in fp32) or, given those reference outputs, the signal and noise
  energies behind each module's SQNR (a few reductions per module, no host sync).

Modules called several times in one step (shared blocks) are matched call by call.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.hooks import RemovableHandle

from ampkit._util.trees import leaves
from ampkit.diagnose.core.stats import merge_ranges, pending_range
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["ModuleRecorder", "energy_pair", "float_tensors", "module_of_param", "reduction_dtype", "upcast"]


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a (nested) module output, in pytree order."""
    return [t for t in leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def upcast(x: Any) -> Any:
    """A low-precision (fp16/bf16) tensor as fp32; anything else as it is (a ``tree_map`` leaf function)."""
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION_DTYPES else x


def reduction_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (for sums that must not lose small terms), else float32."""
    return torch.float32 if device.type == "mps" else torch.float64


def energy_pair(ref: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖ref‖², ‖ref − x‖²) on ``ref``'s device; ``x`` is compared in ``ref``'s dtype.

    The norms are reduced in ``ref``'s dtype (fp32: no widening copy of every activation; the
    norm only overflows for values beyond ~1e19) and squared in float64.
    """
    acc = reduction_dtype(ref.device)
    sig = torch.linalg.vector_norm(ref).to(acc).square()
    noise = torch.linalg.vector_norm(ref - x.to(ref.dtype)).to(acc).square()
    return sig, noise


def module_of_param(model: nn.Module) -> dict[str, str]:
    """Parameter name -> dotted name of the module that owns it directly."""
    return {name: name.rpartition(".")[0] for name, _ in model.named_parameters()}


class ModuleRecorder:
    """Forward hooks on every sub-module of ``model``; use as a context manager.

    Args:
        model: the (copied) model to observe.
        stats: queue the range of every module output.
        keep_outputs: keep detached float32 copies of the outputs (the fp32 shadow), taken when the
            module returns, so a later in-place op (``ReLU(inplace=True)`` after a BatchNorm) cannot
            rewrite the kept value before it is compared.
        reference: outputs kept by a previous recorder (same architecture): compute the SQNR
            energies of this run's outputs against them.
        only: restrict statistics and comparisons to these module names (None: all).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        stats: bool = True,
        keep_outputs: bool = False,
        reference: dict[str, list[list[torch.Tensor]]] | None = None,
        only: set[str] | None = None,
    ) -> None:
        self.model = model
        self.stats = stats
        self.keep_outputs = keep_outputs
        self.reference = reference
        self.only = only
        self.stack: list[str] = []
        self.autocast = False
        """Autocast was on when the innermost running forward began (read here because inside a
        dispatch mode torch reports autocast as off)."""
        self.calls: dict[str, int] = defaultdict(int)
        self.order: list[str] = []
        """Module names in the order their forward completed (first call of each)."""
        self.outputs: dict[str, list[list[torch.Tensor]]] = defaultdict(list)
        self.out_ranges: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.energies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.root_output: list[torch.Tensor] = []
        self._handles: list[RemovableHandle] = []
        self._copies: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        """(data_ptr, version, shape, stride, dtype) -> (the tensor, its kept copy)."""

    @property
    def current(self) -> str | None:
        """Dotted name of the innermost module whose forward is running ("" = the model itself)."""
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> ModuleRecorder:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._make_pre(name)))
            self._handles.append(module.register_forward_hook(self._make_post(name), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()
        self._copies.clear()  # the kept copies stay in self.outputs; the originals may go

    def _make_pre(self, name: str) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
            self.autocast = torch._C._is_any_autocast_enabled()

        return pre

    def _make_post(self, name: str) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            self._record(name, output)

        return post

    def _kept(self, t: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``t`` as it is now, shared by the modules that return the same tensor unchanged.

        Costs one fp32 copy of each distinct activation, in the replay only: ``.float()`` of an fp32
        tensor is the tensor itself, and the next in-place op would rewrite it.  The tensor is held
        with its copy so that its memory (the key) cannot be reused by another one meanwhile; a
        parent returning its last child's output, unmodified (same version), shares the copy."""
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter: copy every time
            return t.detach().to(torch.float32, copy=True)
        key = (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype)
        held = self._copies.get(key)
        if held is None or held[0] is not t:
            held = (t, t.detach().to(torch.float32, copy=True))
            self._copies[key] = held
        return held[1]

    def _record(self, name: str, output: Any) -> None:
        # The recorder's own reductions must not show up in (or be attributed by) the op tracer.
        with _disable_current_modes():
            self._record_untraced(name, output)

    def _record_untraced(self, name: str, output: Any) -> None:
        call = self.calls[name]
        self.calls[name] = call + 1
        if call == 0:
            self.order.append(name)
        tensors = float_tensors(output)
        if name == "" and not self.root_output:
            self.root_output = [t.detach() for t in tensors]
        if not tensors or (self.only is not None and name not in self.only):
            return
        if self.stats:
            self.out_ranges[name].append(merge_ranges([pending_range(t) for t in tensors]))
        if self.keep_outputs:
            self.outputs[name].append([self._kept(t) for t in tensors])
        if self.reference is not None:
            ref_calls = self.reference.get(name, [])
            if call < len(ref_calls) and len(ref_calls[call]) == len(tensors):
                pairs = [energy_pair(r, t.detach()) for r, t in zip(ref_calls[call], tensors)
                         if r.shape == t.shape]
                if pairs:
                    sig = torch.stack([p[0] for p in pairs]).sum()
                    noise = torch.stack([p[1] for p in pairs]).sum()
                    self.energies[name].append((sig, noise))
