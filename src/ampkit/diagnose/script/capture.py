"""``Capture``: one forward of a user's model as the script doctor keeps it, to replay that step.

The models service (``script.models``) makes one per forward of a model: the batch, the RNG and
autocast state it ran with, its outputs and the gradients that flowed back into them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["Capture"]


@dataclass(eq=False)
class Capture:
    """One forward call of a root model, enough to replay it.

    Compared by identity: each is one event, and a field-by-field comparison would ask tensors for
    their truth (a window's ``list.remove`` compares the captures it passes on the way)."""

    root: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    step: int
    device: torch.device
    param_dtype: torch.dtype | None
    autocast_enabled: bool
    """Autocast was on for the model's own device type during this forward."""
    autocast_dtype: torch.dtype
    other_autocast: tuple[str, ...]
    """Device types with autocast on while the model's own device type had it off."""
    rng_cpu: torch.Tensor
    rng_device: torch.Tensor | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    """The floating outputs that require grad, detached (holding them keeps no graph alive)."""
    untracked_outputs: list[torch.Tensor] = field(default_factory=list)
    """The floating outputs that do not require grad (a frozen teacher under ``torch.no_grad``): checked
    for finiteness with the others, since a non-finite one can make the loss non-finite first."""
    grad_fns: list[Any] = field(default_factory=list)
    """Their autograd nodes, kept only until their backward (or the model's next forward)."""
    grads: list[torch.Tensor | None] = field(default_factory=list)
    """Gradient flowing into each output during the user's backward (as autograd delivered it)."""
    grads_fp32: list[torch.Tensor | None] = field(default_factory=list)
    """The same gradient before a cast to the output's low-precision dtype, when a cast consumed it."""
    location: str | None = None
    """The user's line that called the model."""
    running_before: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """(running-stat buffers, their values before this forward)."""
    loss: torch.Tensor | None = None
    """The unscaled loss the user backpropagated after this forward."""
    scale: torch.Tensor | None = None
    """The loss scale of that backward (a copy), or None when the loss was not scaled."""
    grad_enabled: bool = True
    """Autograd was recording during this forward (False under ``torch.no_grad``/``inference_mode``)."""
    training: bool = True
    """The model was in train mode (``model.eval()`` sets False)."""
    entered_inside: list[Any] = field(default_factory=list)
    """Markers of the framework autocast that this forward entered itself (Accelerate wraps
    ``model.forward`` in one): ``autocast`` instances used as decorators, ``(file, line)`` of other
    entries.  ``autocast_enabled``/``autocast_dtype`` then describe it; a replay applies that
    autocast around the whole forward and switches these entries off (``script.replay``)."""

    @property
    def low_precision(self) -> torch.dtype | None:
        """The low-precision dtype this forward ran in (autocast or half parameters), or None."""
        if self.autocast_enabled and self.autocast_dtype in LOW_PRECISION_DTYPES:
            return self.autocast_dtype
        return self.param_dtype if self.param_dtype in LOW_PRECISION_DTYPES else None

    def outputs_finite(self) -> bool:
        """Whether every captured output is finite (a host read: failure path only)."""
        return all(bool(torch.isfinite(o.detach()).all()) for o in (*self.outputs, *self.untracked_outputs))

    def grads_finite(self) -> bool | None:
        """Whether the gradients that reached the outputs are finite (pre-cast ones where kept); None
        when no gradient was captured.  A host read: failure path only."""
        grads = [g32 if g32 is not None else g for g, g32 in zip(self.grads, self.grads_fp32)
                 if (g32 if g32 is not None else g) is not None]
        if not grads:
            return None
        return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)

    @contextlib.contextmanager
    def running_stats_before(self) -> Iterator[None]:
        """Temporarily put the model's running statistics back to their values before this forward."""
        if self.running_before is None:
            yield
            return
        buffers, before = self.running_before
        now = torch._foreach_mul(buffers, 1.0)
        with torch.no_grad():
            torch._foreach_copy_(buffers, before)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(buffers, now)

    def float_inputs(self) -> Iterator[torch.Tensor]:
        leaves, _ = tree_flatten((self.args, self.kwargs))
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                yield x
