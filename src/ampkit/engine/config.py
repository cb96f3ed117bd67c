"""``EngineConfig``: everything that decides how an engine trains, in one frozen object.

The engine keeps its configuration here and derives the rest from it: its ``repr``, the
``precision`` / ``grad_accumulation`` entries of its ``state_dict``, and the descriptor that
``ampkit.distributed.setup`` compares across ranks (``describe()``).  The loss scaler is not
configuration but state (its scale moves every step); the engine holds it next to the config.

>>> from ampkit.precision import Precision
>>> cfg = EngineConfig(precision=Precision.parse("bf16", "cpu"), grad_accumulation=2)
>>> cfg.describe()["grad_accumulation"], cfg.describe()["precision"]
(2, 'bf16')
>>> EngineConfig(precision=cfg.precision, grad_accumulation=0)
Traceback (most recent call last):
...
ValueError: MixedPrecision(grad_accumulation=0): must be an int >= 1 (the number of micro-batches per optimizer step)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ampkit.fp8 import Fp8Filter, check_fp8_filter, describe_fp8_filter
from ampkit.policy import KeepFp32Rule, check_keep_fp32, rule_names
from ampkit.precision import Precision

__all__ = ["EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an engine trains; validated on construction (the errors name ``MixedPrecision``'s arguments)."""

    precision: Precision
    """The resolved precision: autocast dtype, whether loss scaling is needed, and the device."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step (``backward`` divides each loss by it)."""
    clip_grad_norm: float | None = None
    """Max global L2 norm of the unscaled gradients, or None to not clip."""
    keep_fp32: tuple[KeepFp32Rule, ...] = ()
    """Module name patterns or ``nn.Module`` types that run in fp32 (applied by ``prepare``); None is taken as ()."""
    skip_nonfinite: bool = True
    """Skip steps whose gradients or loss hold inf/NaN even without loss scaling."""
    fp8_filter: Fp8Filter = ()
    """fp8 only: which ``nn.Linear`` layers ``prepare`` converts beyond the default (those with in/out
    features multiples of 16, outside ``keep_fp32``): name patterns / types to keep out, a
    ``(module, fqn) -> bool`` callable, or ``"auto"`` (``ampkit.fp8.check_fp8_filter``)."""

    def __post_init__(self) -> None:
        ga = self.grad_accumulation
        if not (isinstance(ga, int) and ga >= 1):
            raise ValueError(
                f"MixedPrecision(grad_accumulation={ga!r}): must be an int >= 1 "
                "(the number of micro-batches per optimizer step)"
            )
        clip = self.clip_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real)):
            raise TypeError(
                f"MixedPrecision(clip_grad_norm={clip!r}): must be a number > 0 (the max gradient norm, "
                f"e.g. 1.0), or None to not clip; got a {type(clip).__name__} (convert it with float(...))"
            )
        if clip is not None and not clip > 0:
            raise ValueError(f"MixedPrecision(clip_grad_norm={clip!r}): must be > 0, or None to not clip")
        object.__setattr__(self, "keep_fp32", check_keep_fp32(self.keep_fp32))
        object.__setattr__(self, "fp8_filter", check_fp8_filter(self.fp8_filter))
        if self.fp8_filter != () and not self.precision.is_fp8:
            raise ValueError(
                f"MixedPrecision({self.precision.name!r}, fp8_filter=...): fp8_filter chooses the Linear layers "
                "that fp8 converts and has no effect on other precisions; pass precision='fp8', 'fp8-rowwise' or "
                "'fp8-rowwise-gw-hp', or drop fp8_filter"
            )

    @property
    def keep_fp32_names(self) -> list[str]:
        """The keep-fp32 rules as strings (a type by its qualified name), for JSON and messages."""
        return rule_names(self.keep_fp32)

    def describe(self) -> dict[str, Any]:
        """The configuration as JSON-able values (what ``repr`` shows and ranks must agree on)."""
        return {
            "precision": self.precision.name,
            "device_type": self.precision.device.type,
            "grad_accumulation": self.grad_accumulation,
            "clip_grad_norm": self.clip_grad_norm,
            "skip_nonfinite": self.skip_nonfinite,
            "keep_fp32": self.keep_fp32_names,
            # Only fp8 engines carry the key, so other engines describe themselves as before.
            **({"fp8_filter": describe_fp8_filter(check_fp8_filter(self.fp8_filter))} if self.precision.is_fp8 else {}),
        }
