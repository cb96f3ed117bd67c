"""``ampkit.lint.rules.precision``: AMP111 (a scaler with bf16), AMP112 (fp16 without scaling)."""

from __future__ import annotations

from . import hits


def test_precision_scaler_flag_unrelated_to_the_dtype_is_not_judged() -> None:
    assert hits(
        "import torch\n"
        "def train(model, opt, loader, use_amp, use_bf16):\n"
        "    dtype = torch.bfloat16 if use_bf16 else torch.float16\n"
        "    scaler = torch.amp.GradScaler('cuda', enabled=use_amp)\n"
        "    for x in loader:\n"
        "        with torch.autocast('cuda', dtype=dtype):\n"
        "            loss = model(x)\n"
        "        scaler.scale(loss).backward()\n"
    ) == []


def test_precision_scaler_flag_bound_to_a_bf16_comparison_is_reported() -> None:
    assert hits(
        "import torch\n"
        "def train(model, opt, loader, amp_dtype):\n"
        "    use_scaler = amp_dtype == torch.bfloat16\n"
        "    scaler = torch.amp.GradScaler('cuda', enabled=use_scaler)\n"
        "    for x in loader:\n"
        "        with torch.autocast('cuda', dtype=amp_dtype):\n"
        "            loss = model(x)\n"
        "        scaler.scale(loss).backward()\n"
    ) == [(4, "AMP111")]


def test_precision_device_given_by_a_parameter_name_is_not_judged() -> None:
    assert hits(
        "import torch\n"
        "def train(model, loader, device_type):\n"
        "    for x in loader:\n"
        "        with torch.autocast(device_type):\n"
        "            loss = model(x)\n"
        "        loss.backward()\n"
    ) == []
