from __future__ import annotations

import pytest
import torch

from ampkit import Precision, PrecisionError
from ampkit.precision import FP8_RECIPES, PRECISION_ALIASES, PRECISION_NAMES
from ampkit.verify.report import load_schema


@pytest.mark.parametrize(
    ("spec", "name"),
    [("fp32", "fp32"), ("32", "fp32"), ("32-true", "fp32"), ("no", "fp32"), ("bf16", "bf16"),
     ("bf16-mixed", "bf16"), ("fp16", "fp16"), ("16", "fp16"), ("16-mixed", "fp16"), ("BF16", "bf16")],
)
def test_precision_parses_every_alias(spec: str, name: str) -> None:
    p = Precision.parse(spec, device="cpu")
    assert p.name == name
    assert p.device == torch.device("cpu")


def test_precision_names_are_every_alias_target_and_the_schema_enum() -> None:
    # PrecisionName is the closed set: every spelling parses to one of its names, each name parses
    # to itself (it has a dtype), and the verify report's schema lists the same names.
    assert set(PRECISION_NAMES) == set(PRECISION_ALIASES.values()) - {"auto"}
    assert [Precision.parse(n, device="cpu").name for n in PRECISION_NAMES] == list(PRECISION_NAMES)
    assert set(FP8_RECIPES) <= set(PRECISION_NAMES)
    assert load_schema()["$defs"]["precision"]["enum"] == list(PRECISION_NAMES)


def test_precision_dtypes_and_scaling_flags() -> None:
    fp16, bf16, fp32 = (Precision.parse(n, device="cpu") for n in ("fp16", "bf16", "fp32"))
    assert (fp16.dtype, bf16.dtype, fp32.dtype) == (torch.float16, torch.bfloat16, torch.float32)
    assert fp16.needs_loss_scaling and not bf16.needs_loss_scaling and not fp32.needs_loss_scaling
    assert not fp32.autocast_enabled and bf16.autocast_enabled


def test_precision_bad_name_lists_accepted_names() -> None:
    with pytest.raises(ValueError, match="accepted names") as info:
        Precision.parse("fp4", device="cpu")
    for alias in PRECISION_ALIASES:
        assert repr(alias) in str(info.value)


def test_precision_auto_on_cpu_follows_bf16_isa() -> None:
    from ampkit.precision import cpu_has_fast_bf16

    expected = "bf16" if cpu_has_fast_bf16() else "fp32"
    assert Precision.parse("auto", device="cpu").name == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a missing CUDA device")
def test_precision_unavailable_device_names_alternative() -> None:
    with pytest.raises(PrecisionError, match="not available.*device='cpu'"):
        Precision.parse("bf16", device="cuda")


def test_precision_unknown_device_type_is_rejected() -> None:
    with pytest.raises(PrecisionError, match="supports cpu, cuda, mps, xpu"):
        Precision.parse("bf16", device="meta")
    with pytest.raises(PrecisionError, match="is not a device"):
        Precision.parse("bf16", device="gpu0")
