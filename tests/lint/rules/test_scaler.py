"""``ampkit.lint.rules.scaler``: AMP102, AMP103, AMP115, AMP116, judged on paths."""

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


def test_scaler_skip_at_an_accumulation_boundary_is_reported_once_as_amp103() -> None:
    assert hits(
        "import torch\n"
        "def train(optimizer, scaler, loader, k):\n"
        "    for i, loss in enumerate(loader):\n"
        "        scaler.scale(loss).backward()\n"
        "        scaler.unscale_(optimizer)\n"
        "        if (i + 1) % k == 0:\n"
        "            scaler.step(optimizer)\n"
        "            scaler.update()\n"
    ) == [(5, "AMP103")]


def test_scaler_scheduler_behind_an_existence_check_is_still_unconditional() -> None:
    assert hits(
        "import torch\n"
        "def train(model, optimizer, scheduler, loader, scaler):\n"
        "    for x in loader:\n"
        "        scaler.scale(model(x)).backward()\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
        "        if scheduler is not None:\n"
        "            scheduler.step()\n"
    ) == [(8, "AMP115")]


def test_scaler_update_reached_on_every_path_after_a_correlated_branch_is_clean() -> None:
    assert hits(
        "import torch\n"
        "def step(optimizer, scaler, loss, use_amp):\n"
        "    if use_amp:\n"
        "        scaler.scale(loss).backward()\n"
        "        scaler.unscale_(optimizer)\n"
        "    else:\n"
        "        loss.backward()\n"
        "    if use_amp:\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
        "    else:\n"
        "        optimizer.step()\n"
    ) == []


def test_scaler_break_after_step_skips_the_update_of_that_loop() -> None:
    assert hits(
        "import torch\n"
        "def train(optimizer, scaler, loader, limit):\n"
        "    for i, loss in enumerate(loader):\n"
        "        scaler.scale(loss).backward()\n"
        "        scaler.step(optimizer)\n"
        "        if i == limit:\n"
        "            break\n"
        "        scaler.update()\n"
    ) == [(7, "AMP116")]


def test_scaler_unscale_written_between_on_another_branch_is_not_judged() -> None:
    assert hits(
        "import torch\n"
        "def train(model, optimizer, loader, scaler, args):\n"
        "    for x in loader:\n"
        "        scaler.scale(model(x)).backward()\n"
        "        if args.amp:\n"
        "            scaler.unscale_(optimizer)\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
    ) == []


def test_scaler_update_skipped_by_a_test_other_than_the_one_guarding_unscale_is_not_judged() -> None:
    assert hits(
        "import torch\n"
        "def step(self, loss, opt):\n"
        "    self.scaler.scale(loss).backward()\n"
        "    if self.scaler.is_enabled():\n"
        "        self.scaler.unscale_(opt)\n"
        "    if self.use_amp:\n"
        "        self.scaler.step(opt)\n"
        "        self.scaler.update()\n"
        "    else:\n"
        "        opt.step()\n"
    ) == []
