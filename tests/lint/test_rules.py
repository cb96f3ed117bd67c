"""Rule decisions the golden fixtures do not spell out: flow through names, cases left undecided."""

from __future__ import annotations

from ampkit.lint import lint_source


def hits(source: str) -> list[tuple[int, str]]:
    return [(v.line, v.code) for v in lint_source(source)]


def test_rules_clip_check_follows_a_named_scaled_loss() -> None:
    assert hits(
        "import torch\n"
        "def step(model, opt, scaler, loss):\n"
        "    scaled = scaler.scale(loss)\n"
        "    scaled.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
    ) == [(5, "AMP102")]


def test_rules_deprecated_api_behind_a_version_check_is_deliberate() -> None:
    assert hits(
        "import torch\n"
        "TORCH_GE_2_4 = True\n"
        "a = torch.amp.GradScaler('cuda') if TORCH_GE_2_4 else torch.cuda.amp.GradScaler()\n"
        "try:\n"
        "    from torch.amp import GradScaler\n"
        "    b = GradScaler('cuda')\n"
        "except ImportError:\n"
        "    b = torch.cuda.amp.GradScaler()\n"
        "c = torch.cuda.amp.GradScaler()\n"
    ) == [(9, "AMP101")]


def test_rules_checkpoint_with_splat_cannot_be_judged() -> None:
    assert hits(
        "import torch\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "def save(model, extra, path):\n"
        "    torch.save({'model': model.state_dict(), **extra}, path)\n"
        "def save_plain(model, path):\n"
        "    torch.save({'model': model.state_dict()}, path)\n"
    ) == [(6, "AMP104")]


def test_rules_bce_on_inline_loss_module() -> None:
    assert hits(
        "import torch\n"
        "def loss(logits, y):\n"
        "    return torch.nn.BCELoss()(torch.sigmoid(logits), y)\n"
    ) == [(3, "AMP106")]


def test_rules_scheduler_in_its_own_branch_is_not_unconditional() -> None:
    assert hits(
        "import torch\n"
        "def train(model, optimizer, scheduler, loader, scaler):\n"
        "    for x in loader:\n"
        "        scaler.scale(model(x)).backward()\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
        "        if not scaler._found_inf_per_device(optimizer):\n"
        "            scheduler.step()\n"
    ) == []


def test_rules_update_in_finally_is_reached_by_the_early_return() -> None:
    assert hits(
        "import torch\n"
        "def step(optimizer, scaler, loss, stop):\n"
        "    scaler.scale(loss).backward()\n"
        "    try:\n"
        "        scaler.step(optimizer)\n"
        "        if stop:\n"
        "            return\n"
        "    finally:\n"
        "        scaler.update()\n"
    ) == []


def test_rules_continue_of_an_inner_loop_does_not_skip_the_update() -> None:
    assert hits(
        "import torch\n"
        "def train(optimizer, scaler, batches):\n"
        "    for batch in batches:\n"
        "        scaler.scale(batch.loss).backward()\n"
        "        scaler.unscale_(optimizer)\n"
        "        for p in batch.params:\n"
        "            if p.grad is None:\n"
        "                continue\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
    ) == []


def test_rules_masked_fill_in_a_plain_fp32_file_is_not_judged() -> None:
    # No autocast/fp16 in the file, not an nn.Module method: the tensor's dtype is unknown.
    assert hits(
        "import torch\n"
        "def mask(scores, m):\n"
        "    return scores.masked_fill(m, -1e9)\n"
    ) == []
