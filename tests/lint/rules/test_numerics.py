"""``ampkit.lint.rules.numerics``: AMP105, AMP106, AMP114."""

from __future__ import annotations

import pytest

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


_MODULE = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\nclass Block(nn.Module):\n    def forward(self, x, i, m):\n"


@pytest.mark.parametrize("write", [
    "x.clamp(min=-1e9)", "x.clamp(-1e5, 1e5)", "torch.clamp(x, max=1e6)", "x.clamp_min_(-1e9)", "x.clip(max=1e9)",
    "torch.clip(x, -1e9)", "x.scatter(1, i, -1e9)", "x.scatter_(1, i, value=-1e9)", "x.index_fill(0, i, -1e9)",
    "torch.index_fill(x, 0, i, -1e9)", "x.fill_(-1e9)", "x.fill_diagonal_(-1e9)", "F.threshold(x, 0.0, -1e9)",
    "torch.threshold(x, 0.0, value=-1e9)", "F.hardtanh(x, -1e5, 1e5)", "torch.constant_pad_nd(x, (1, 1), -1e9)",
])
def test_numerics_amp105_any_write_of_a_number_from_torch_signatures(write: str) -> None:
    # Each of these raises "value cannot be converted to type at::Half without overflow" on an fp16 x.
    assert hits(_MODULE + f"        return {write}\n") == [(7, "AMP105")]


@pytest.mark.parametrize("call", [
    "x.clamp(min=1e-9)", "x.addcmul(i, m, value=1e9)", "torch.histc(x, min=-1e9, max=1e9)",
    "x.scatter(1, i, m)", "x.clamp(min=m)", "x.masked_fill(m, -6e4)",
])
def test_numerics_amp105_not_for_a_factor_a_bound_a_tensor_or_an_in_range_number(call: str) -> None:
    assert hits(_MODULE + f"        return {call}\n") == []


@pytest.mark.parametrize("update", [
    "ema.mul_(0.99).add_(x, alpha=0.01)", "ema.lerp_(x, 0.01)", "ema.copy_(0.99 * ema + 0.01 * x)",
    "ema = 0.99 * ema + 0.01 * x", "ema = torch.lerp(ema, x, 0.01)", "ema.addcmul_(x, x, value=0.01)",
    "ema = ema + 0.01 * (x - ema)",
])
def test_numerics_amp114_running_average_in_low_precision_however_it_is_updated(update: str) -> None:
    assert hits(_tracker(update)) == [(5, "AMP114")]


@pytest.mark.parametrize("update", ["ema.mul_(0.99)", "ema = ema.float()", "ema.copy_(x)", "ema = x * 2"])
def test_numerics_amp114_not_a_rescale_a_cast_or_a_plain_overwrite(update: str) -> None:
    assert hits(_tracker(update)) == []


def _tracker(update: str) -> str:
    """A function keeping an fp16 ``ema`` updated by ``update`` (line 5) in a loop."""
    return ("import torch\n"
            "def track(stream):\n"
            "    ema = torch.zeros(4, dtype=torch.float16)\n"
            "    for x in stream:\n"
            f"        {update}\n"
            "    return ema\n")


@pytest.mark.parametrize("source, line", [
    ("import torch\nimport torch.nn.functional as F\ndef nll(x, y):\n    p = F.softmax(x, dim=-1)\n"
     "    keep = p[torch.arange(len(y)), y]\n    return -torch.log(keep).mean()\n", 6),
    ("import torch\ndef nll(x, y):\n    p = x.softmax(-1)\n    return -(p.gather(1, y[:, None]).log()).mean()\n", 4),
    ("import torch\nimport torch.nn.functional as F\ndef probs(x):\n    return F.softmax(x, dim=-1)\n"
     "def nll(x, y):\n    return -torch.log(torch.gather(probs(x), 1, y[:, None]) + 1e-8).mean()\n", 6),
    ("import torch\ndef gate(x):\n    return torch.sigmoid(x)\ndef loss(x):\n    g = gate(x)\n    return g[:, 0].log().sum()\n", 6),
])
def test_numerics_amp106_follows_a_selection_a_variable_and_a_helper(source: str, line: int) -> None:
    assert hits(source) == [(line, "AMP106")]


def test_numerics_amp106_not_for_a_helper_that_returns_something_else() -> None:
    assert hits("import torch\ndef probs(x):\n    return x.exp() / x.exp().sum()\n"
                "def nll(x, y):\n    return -torch.log(probs(x)[:, 0]).mean()\n") == []
