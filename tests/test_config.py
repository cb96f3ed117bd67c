"""EngineConfig (ampkit.engine.config): validation, and the engine's repr / state / descriptor derived from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ampkit
from ampkit.engine import EngineConfig
from ampkit.precision import Precision


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = EngineConfig(precision=Precision.parse("bf16", "cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grad_accumulation = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineConfig(Precision.parse("bf16", "cpu"))  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, match", [
    ({"grad_accumulation": 0}, r"grad_accumulation=0\): must be an int >= 1"),
    ({"grad_accumulation": 1.5}, r"grad_accumulation=1.5\)"),
    ({"clip_grad_norm": 0.0}, r"clip_grad_norm=0.0\): must be > 0"),
])
def test_config_rejects_invalid_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(precision=Precision.parse("bf16", "cpu"), **kwargs)
    with pytest.raises(ValueError, match=match):
        ampkit.MixedPrecision("bf16", device="cpu", **kwargs)


def test_config_engine_views_derive_from_it() -> None:
    mp = ampkit.MixedPrecision("bf16", device="cpu", grad_accumulation=4, clip_grad_norm=2.0,
                               keep_fp32=["head", torch.nn.LayerNorm], skip_nonfinite=False)
    described = mp.config.describe()
    assert described == {
        "precision": "bf16", "device_type": "cpu", "grad_accumulation": 4, "clip_grad_norm": 2.0,
        "skip_nonfinite": False, "keep_fp32": ["head", "torch.nn.modules.normalization.LayerNorm"],
    }
    assert (mp.precision.name, mp.grad_accumulation, mp.clip_grad_norm, mp.skip_nonfinite) == ("bf16", 4, 2.0, False)
    state = mp.state_dict()
    assert (state["precision"], state["grad_accumulation"]) == ("bf16", 4)
    assert "grad_accumulation=4" in repr(mp) and "clip_grad_norm=2.0" in repr(mp) and "skip_nonfinite=False" in repr(mp)


@pytest.mark.parametrize("clip", ["1.0", True, [1.0]])
def test_config_rejects_a_non_numeric_clip_grad_norm_by_name(clip: object) -> None:
    with pytest.raises(TypeError, match=r"MixedPrecision\(clip_grad_norm=.*\): must be a number > 0 .* or None"):
        ampkit.MixedPrecision("bf16", device="cpu", clip_grad_norm=clip)


@pytest.mark.parametrize("rule", ["lm_head", torch.nn.LayerNorm])
def test_config_bare_keep_fp32_rule_names_the_list_form(rule: object) -> None:
    with pytest.raises(TypeError, match=r"keep_fp32=.*: give a list .*keep_fp32=\["):
        EngineConfig(precision=Precision.parse("bf16", "cpu"), keep_fp32=rule)  # type: ignore[arg-type]
