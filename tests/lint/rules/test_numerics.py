"""``ampkit.lint.rules.numerics``: AMP105, AMP106, AMP114."""

from __future__ import annotations

from . import hits


def test_numerics_bce_on_inline_loss_module() -> None:
    assert hits(
        "import torch\n"
        "def loss(logits, y):\n"
        "    return torch.nn.BCELoss()(torch.sigmoid(logits), y)\n"
    ) == [(3, "AMP106")]


def test_numerics_masked_fill_in_a_plain_fp32_file_is_not_judged() -> None:
    # No autocast/fp16 in the file, not an nn.Module method: the tensor's dtype is unknown.
    assert hits(
        "import torch\n"
        "def mask(scores, m):\n"
        "    return scores.masked_fill(m, -1e9)\n"
    ) == []
