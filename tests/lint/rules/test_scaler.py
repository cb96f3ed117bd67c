"""``ampkit.lint.rules.scaler``: AMP102, AMP103, AMP104, AMP111, AMP112, AMP115, AMP116."""

from __future__ import annotations

from . import hits


def test_scaler_clip_check_follows_a_named_scaled_loss() -> None:
    assert hits(
        "import torch\n"
        "def step(model, opt, scaler, loss):\n"
        "    scaled = scaler.scale(loss)\n"
        "    scaled.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
    ) == [(5, "AMP102")]


def test_scaler_checkpoint_with_splat_cannot_be_judged() -> None:
    assert hits(
        "import torch\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "def save(model, extra, path):\n"
        "    torch.save({'model': model.state_dict(), **extra}, path)\n"
        "def save_plain(model, path):\n"
        "    torch.save({'model': model.state_dict()}, path)\n"
    ) == [(6, "AMP104")]


def test_scaler_scheduler_in_its_own_branch_is_not_unconditional() -> None:
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


def test_scaler_update_in_finally_is_reached_by_the_early_return() -> None:
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


def test_scaler_continue_of_an_inner_loop_does_not_skip_the_update() -> None:
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
