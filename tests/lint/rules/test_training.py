"""``ampkit.lint.rules.training``: AMP107 (model trained in fp16/bf16), AMP108 (step inside autocast)."""

from __future__ import annotations

from ampkit.lint import lint_source

from . import hits


def test_training_model_cast_with_to_is_named_in_torch_spelling() -> None:
    (violation,) = lint_source(
        "import torch\n"
        "def build(net):\n"
        "    model = net.to('cuda', torch.bfloat16)\n"
        "    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3)\n"
        "    return model, opt\n"
    )
    assert (violation.line, violation.code) == (3, "AMP107")
    assert violation.message.startswith("model is converted to bfloat16 and its parameters are trained")


def test_training_half_model_is_reported_only_for_a_known_optimizer() -> None:
    assert hits(
        "import torch\n"
        "from lion_pytorch import Lion\n"
        "model = Net().half()\n"
        "params = model.parameters()\n"
        "optimizer = Lion(params)\n"
    ) == []
    assert hits(
        "import torch\n"
        "from torch.optim import SGD\n"
        "model = Net().half()\n"
        "params = model.parameters()\n"
        "optimizer = SGD(params, lr=0.1)\n"
    ) == [(3, "AMP107")]


def test_training_step_in_a_disabled_autocast_block_is_not_reported() -> None:
    assert hits(
        "import torch\n"
        "def train(model, optimizer, x):\n"
        "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
        "        loss = model(x)\n"
        "        with torch.autocast('cuda', enabled=False):\n"
        "            loss.backward()\n"
        "            optimizer.step()\n"
        "        optimizer.step()\n"
    ) == [(8, "AMP108")]
