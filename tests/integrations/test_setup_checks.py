"""Setup checks shared by the framework integrations (plain torch objects, no framework)."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.integrations.setup_checks import PrecisionInEffect, setup_checks


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).to(dtype)


def test_setup_checks_reports_fp16_requested_and_fp32_in_effect_as_mixed_precision_off() -> None:
    precision = PrecisionInEffect("fp16", "fp32", setting="TrainingArguments(fp16=True)",
                                  reason="no CUDA device", turn_on="pass bf16=True on CPU")
    found = setup_checks(precision=precision, model=_model(), framework="Trainer")
    assert [f.code for f in found] == ["MIXED_PRECISION_OFF"]
    assert found[0].message.startswith("TrainingArguments(fp16=True) asks for mixed precision")
    assert found[0].fix.startswith("pass bf16=True on CPU") and found[0].evidence["actual"] == "fp32"


def test_setup_checks_reports_bf16_trainable_params_with_their_names() -> None:
    model = _model(torch.bfloat16)
    model[1].requires_grad_(False)
    found = setup_checks(requested="bf16", actual="bf16", model=model,
                         optimizers=[torch.optim.SGD(model[0].parameters(), lr=0.1)])
    assert [f.code for f in found] == ["LOW_PRECISION_PARAMS"]
    assert found[0].evidence["examples"] == ["0.weight", "0.bias"] and found[0].evidence["dtypes"] == ["bf16"]


def test_setup_checks_low_precision_params_fix_names_the_frameworks_own_precision_setting() -> None:
    fixes = {framework: setup_checks(requested="bf16", actual="bf16", model=_model(torch.bfloat16),
                                     framework=framework)[0].fix
             for framework in ("Lightning", "Accelerate", "Trainer")}
    assert "Trainer(precision='bf16-mixed'" in fixes["Lightning"] and "bf16=True" not in fixes["Lightning"]
    assert "Accelerator(mixed_precision='bf16'" in fixes["Accelerate"] and "bf16=True" not in fixes["Accelerate"]
    assert "TrainingArguments(bf16=True" in fixes["Trainer"]


def test_setup_checks_reports_a_scaler_used_with_bf16() -> None:
    found = setup_checks(requested="bf16", actual="bf16", model=_model(), scaler=torch.amp.GradScaler("cpu"))
    assert [f.code for f in found] == ["SCALER_WITH_BF16"]


def test_setup_checks_notes_fused_optimizer_with_fp16_skips_and_passes_a_plain_one() -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    fused = setup_checks(requested="fp16", actual="fp16", model=model, scaler=scaler,
                         optimizers=[torch.optim.AdamW(model.parameters(), fused=True)])
    plain = setup_checks(requested="fp16", actual="fp16", model=model, scaler=scaler,
                         optimizers=[torch.optim.AdamW(model.parameters())])
    assert [(f.code, f.severity) for f in fused] == [("SCHEDULER_STEPPED_ON_SKIP", "info")]
    assert plain == []


def test_setup_checks_finds_nothing_in_a_healthy_fp32_setup() -> None:
    model = _model()
    assert setup_checks(actual="fp32", model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)]) == []
