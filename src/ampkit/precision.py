"""Precision names, their dtypes, and what a device can actually run.

``Precision.parse("bf16-mixed", device="cuda")`` turns the names users already know from
Lightning and Accelerate into one explicit object: the autocast dtype, whether loss scaling is
needed, and the device it was checked against.

The fp8 precisions (``"fp8"`` = ``"fp8-tensorwise"``, torchao's default recipe, ``"fp8-rowwise"``
and ``"fp8-rowwise-gw-hp"``, rowwise with the weight-gradient GEMM in bf16) run torchao's float8
Linear layers inside bf16 autocast: their autocast dtype is bf16, they need no loss scaling
(torchao scales each tensor itself), and ``fp8_recipe`` names the torchao recipe.  Parsing them
never imports torchao (``ampkit.fp8`` does, when a model is converted).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ampkit._util.isa import BF16_LEVEL, FP16_LEVEL, kernels_allow

__all__ = [
    "DEVICE_TYPES",
    "FP8_RECIPES",
    "LOW_PRECISION_DTYPES",
    "PRECISION_ALIASES",
    "PRECISION_NAMES",
    "FormatName",
    "Fp8RecipeName",
    "Precision",
    "PrecisionError",
    "PrecisionName",
    "cpu_has_fast_bf16",
    "cpu_has_fast_fp16",
    "resolve_device",
]

LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
"""The 16-bit floating formats autocast computes in (what "low precision" means in every finding)."""


class PrecisionError(ValueError):
    """A precision name or device that cannot be used; the message says what to use instead."""


PrecisionName = Literal["fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp"]
"""A canonical precision name (``Precision.name``): what reports, checkpoints and findings record.
Users may spell them otherwise (``PRECISION_ALIASES``); ``Precision.parse`` turns any spelling into one."""

PRECISION_NAMES: tuple[PrecisionName, ...] = get_args(PrecisionName)
"""Every canonical name, in ``PrecisionName``'s order."""

FormatName = Literal["fp16", "bf16", "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8", "nvfp4"]
"""A low-precision format ``ampkit preflight`` judges: the engine's low precisions, and the what-if block formats
MXFP8 and NVFP4, which ampkit emulates through torchao's casts but does not train."""

Fp8RecipeName = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's recipe names (``Float8LinearRecipeName``) that an ampkit fp8 precision trains."""

# Accepted spellings -> canonical name.  "auto" is resolved per device.
PRECISION_ALIASES: dict[str, PrecisionName | Literal["auto"]] = {
    "fp32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "no": "fp32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "fp16": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
    # Accelerate spells it mixed_precision="fp8"; Lightning's fp8 precisions are Transformer
    # Engine's ("transformer-engine"), another library with other numerics, so not aliased here.
    "fp8": "fp8",
    "fp8-tensorwise": "fp8",
    "fp8-rowwise": "fp8-rowwise",
    "fp8-rowwise-gw-hp": "fp8-rowwise-gw-hp",
    "auto": "auto",
}

FP8_RECIPES: dict[PrecisionName, Fp8RecipeName] = {
    "fp8": "tensorwise", "fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
}
"""Canonical fp8 precision name -> the torchao recipe name (``Float8LinearConfig.from_recipe_name``)."""

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")

# fp8 computes its converted Linear layers in fp8 and everything else under bf16 autocast.
_DTYPES: dict[PrecisionName, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8": torch.bfloat16, "fp8-rowwise": torch.bfloat16, "fp8-rowwise-gw-hp": torch.bfloat16}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """Return a concrete ``torch.device``; ``"auto"`` picks cuda, then xpu, then mps, then cpu.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return torch.device("xpu")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PrecisionError(
            f"device={device!r} is not a device; use one of {', '.join(DEVICE_TYPES)} or 'auto'"
        ) from exc
    if dev.type not in DEVICE_TYPES:
        raise PrecisionError(
            f"device={device!r}: ampkit supports {', '.join(DEVICE_TYPES)} (or 'auto'), not {dev.type!r}"
        )
    _require_available(dev)
    return dev


def _require_available(dev: torch.device) -> None:
    probes: dict[str, Callable[[], bool]] = {
        "cpu": lambda: True,
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if not probes[dev.type]():
        raise PrecisionError(
            f"device={str(dev)!r} is not available in this process; use device='cpu' or device='auto' "
            "(run `ampkit env` to see the devices torch can reach)"
        )


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX) and this process's kernels may
    use them (``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` can cap them: ``ampkit._util.isa``); else bf16
    is emulated."""
    return _cpu_flag("_is_avx512_bf16_supported", "_is_amx_tile_supported") and kernels_allow(BF16_LEVEL)


@functools.cache
def cpu_has_fast_fp16() -> bool:
    """True when the CPU has fp16 matrix instructions (AMX-FP16 / AVX512-FP16) that this process's kernels
    may use."""
    return _cpu_flag("_is_amx_fp16_supported", "_is_avx512_fp16_supported") and kernels_allow(FP16_LEVEL)


def _cpu_flag(*probes: str) -> bool:
    # torch.cpu's probes are private and vary by release; a missing probe counts as "no".
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def _bf16_supported(dev: torch.device) -> bool:
    if dev.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if dev.type == "xpu":
        return bool(getattr(torch.xpu, "is_bf16_supported", lambda: True)())
    return True  # cpu emulates where it lacks the ISA; mps has bf16 on macOS 14+ (torch checks at use)


def _bf16_fast(dev: torch.device) -> bool:
    if dev.type == "cpu":
        return cpu_has_fast_bf16()
    if dev.type == "cuda":
        return _bf16_supported(dev) and torch.cuda.get_device_capability(dev) >= (8, 0)
    return _bf16_supported(dev)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """A checked (precision, device) pair.

    Parse a user-facing name, resolve ``auto`` against the device, and refuse combinations the
    device cannot run, naming an alternative.

    >>> p = Precision.parse("16-mixed", device="cpu")
    >>> p.name, p.dtype, p.needs_loss_scaling
    ('fp16', torch.float16, True)
    >>> Precision.parse("bf16", device="cpu").autocast_enabled
    True
    >>> p = Precision.parse("fp8-tensorwise", device="cpu")
    >>> p.name, p.dtype, p.needs_loss_scaling, p.fp8_recipe
    ('fp8', torch.bfloat16, False, 'tensorwise')
    """

    name: PrecisionName
    """Canonical name: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp8-rowwise"`` or ``"fp8-rowwise-gw-hp"``."""
    device: torch.device
    """The device the precision was checked against."""

    @property
    def dtype(self) -> torch.dtype:
        """The autocast compute dtype (``torch.float32`` for fp32)."""
        return _DTYPES[self.name]

    @property
    def autocast_enabled(self) -> bool:
        """Whether ``torch.autocast`` is entered at all."""
        return self.name != "fp32"

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16's 5-bit exponent underflows small gradients; bf16 and fp32 share fp32's range."""
        return self.name == "fp16"

    @property
    def is_low_precision(self) -> bool:
        return self.name != "fp32"

    @property
    def is_fp8(self) -> bool:
        """Whether ``prepare`` converts Linear layers to torchao's float8 training layers."""
        return self.name in FP8_RECIPES

    @property
    def fp8_recipe(self) -> Fp8RecipeName | None:
        """torchao's recipe name (``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``) for fp8, else None."""
        return FP8_RECIPES.get(self.name)

    @classmethod
    def parse(cls, spec: str | Precision, device: str | torch.device | None = "auto") -> Precision:
        """Parse ``spec`` (see ``PRECISION_ALIASES``) for ``device`` and check the device can run it."""
        if isinstance(spec, Precision):
            return spec
        key = str(spec).strip().lower()
        if key not in PRECISION_ALIASES:
            accepted = ", ".join(repr(k) for k in PRECISION_ALIASES)
            raise PrecisionError(f"precision {spec!r} is not known; accepted names: {accepted}")
        dev = resolve_device(device)
        alias = PRECISION_ALIASES[key]
        name = cls._auto(dev) if alias == "auto" else alias
        cls._check(name, dev)
        return cls(name=name, device=dev)

    @staticmethod
    def _auto(dev: torch.device) -> PrecisionName:
        if _bf16_fast(dev):
            return "bf16"
        if dev.type == "cuda":
            return "fp16"
        return "fp32"

    @staticmethod
    def _check(name: PrecisionName, dev: torch.device) -> None:
        if name in FP8_RECIPES and dev.type not in ("cpu", "cuda"):
            raise PrecisionError(
                f"{name} was requested on {dev}: torchao's float8 training runs on cuda (fp8 GEMMs from "
                "compute capability 8.9) and on cpu (slow); use device='cuda' or 'cpu', or precision='bf16'"
            )
        if (name == "bf16" or name in FP8_RECIPES) and not _bf16_supported(dev):
            raise PrecisionError(
                f"{name} was requested on {dev} ({_device_name(dev)}), which does not support bf16; "
                "use precision='fp16' (with loss scaling, the default) or 'fp32'"
            )
        if name == "fp16" and dev.type == "mps" and not torch.backends.mps.is_available():
            raise PrecisionError("fp16 on mps needs a working MPS backend; use device='cpu'")

    def __str__(self) -> str:
        return f"{self.name}@{self.device}"


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return str(torch.cuda.get_device_name(dev))
    return dev.type
