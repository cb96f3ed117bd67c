"""The formats ``ampkit preflight`` judges, and how each is replayed.

Two kinds:

* **trained** formats are the engine's precisions (``MixedPrecision(name)``): fp16 and bf16 under
  autocast, and torchao's three float8 recipes (``fp8`` = tensorwise, ``fp8-rowwise``,
  ``fp8-rowwise-gw-hp``).  Their replay runs the engine's own preparation of the model, so the
  policy preflight proposes is the one the engine applies;
* **what-if** formats (``mxfp8``, ``nvfp4``) are not trained by ampkit.  Their replay swaps each eligible
  ``nn.Linear`` for an emulation of the format's three GEMMs through torchao's own casts
  (``diagnose.core.blockcast``), everything else under bf16 autocast as torchao's MX training runs it,
  and every output marks them ``emulated``.

A policy is what the engine takes to keep layers out of the format: ``keep_fp32=[...]`` for fp16/bf16,
``fp8_filter=[...]`` for the float8 recipes and the block formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from ampkit.precision import FormatName

__all__ = ["ALL_FORMATS", "DEFAULT_FORMATS", "FORMAT_SPECS", "FormatName", "FormatSpec", "parse_formats"]

ALL_FORMATS: tuple[FormatName, ...] = get_args(FormatName)


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """One format: what it is made of and how preflight replays it."""

    name: FormatName
    elements: str
    """The element types as a reader knows them (``"e4m3 forward, e5m2 gradients"``)."""
    scaling: Literal["none", "tensor", "row", "block"]
    """How values are scaled before the cast: ``none`` (fp16/bf16: the headroom to the format's largest
    value decides overflow), per tensor, per row, or per block of 32/16 values along the GEMM's reduction."""
    trained: bool
    """True: an engine precision, replayed as the engine prepares it; False: a what-if format, emulated."""
    policy: Literal["keep_fp32", "fp8_filter"]
    """The engine option that keeps layers out of the format."""

    @property
    def emulated(self) -> bool:
        return not self.trained


FORMAT_SPECS: dict[FormatName, FormatSpec] = {
    "fp16": FormatSpec(name="fp16", elements="fp16", scaling="none", trained=True, policy="keep_fp32"),
    "bf16": FormatSpec(name="bf16", elements="bf16", scaling="none", trained=True, policy="keep_fp32"),
    "fp8": FormatSpec(name="fp8", elements="e4m3 forward, e5m2 gradients", scaling="tensor", trained=True,
                      policy="fp8_filter"),
    "fp8-rowwise": FormatSpec(name="fp8-rowwise", elements="e4m3 forward, e5m2 gradients", scaling="row",
                              trained=True, policy="fp8_filter"),
    "fp8-rowwise-gw-hp": FormatSpec(name="fp8-rowwise-gw-hp",
                                    elements="e4m3 forward, e5m2 gradients, weight gradient in bf16",
                                    scaling="row", trained=True, policy="fp8_filter"),
    "mxfp8": FormatSpec(name="mxfp8", elements="e4m3, e8m0 scale per 32 values", scaling="block", trained=False,
                        policy="fp8_filter"),
    "nvfp4": FormatSpec(name="nvfp4", elements="e2m1, e4m3 scale per 16 values and an fp32 tensor scale",
                        scaling="block", trained=False, policy="fp8_filter"),
}

DEFAULT_FORMATS: tuple[FormatName, ...] = tuple(n for n in ALL_FORMATS if FORMAT_SPECS[n].trained)
"""What ``--formats`` defaults to: the formats the engine trains."""


def parse_formats(value: str | Sequence[str] | None) -> tuple[FormatName, ...]:
    """``"fp16,bf16"``, ``"all"``, a list of names, or None (the trained formats) as format names, in the
    order given, without repeats.

    >>> parse_formats("bf16,fp16,bf16")
    ('bf16', 'fp16')
    >>> parse_formats("all")[-2:]
    ('mxfp8', 'nvfp4')
    >>> parse_formats("fp4")
    Traceback (most recent call last):
    ...
    ValueError: formats='fp4': 'fp4' is not a format; use 'all' or a comma-separated list of fp16, bf16, fp8, fp8-rowwise, fp8-rowwise-gw-hp, mxfp8, nvfp4
    """
    if value is None:
        return DEFAULT_FORMATS
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value)]
    if names == ["all"]:
        return ALL_FORMATS
    chosen: list[FormatName] = []
    for name in names:
        match = next((f for f in ALL_FORMATS if f == name), None)
        if match is None:
            raise ValueError(f"formats={value!r}: {name!r} is not a format; use 'all' or a comma-separated list of "
                             f"{', '.join(ALL_FORMATS)}")
        if match not in chosen:
            chosen.append(match)
    if not chosen:
        raise ValueError(f"formats={value!r}: no format named; use 'all' or a comma-separated list of "
                         f"{', '.join(ALL_FORMATS)}")
    return tuple(chosen)
