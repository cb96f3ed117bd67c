"""``ampkit.lint.rules.checkpoint``: AMP104, a checkpoint without the scaler state."""

from __future__ import annotations

from . import hits


def test_checkpoint_with_splat_cannot_be_judged() -> None:
    assert hits(
        "import torch\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "def save(model, extra, path):\n"
        "    torch.save({'model': model.state_dict(), **extra}, path)\n"
        "def save_plain(model, path):\n"
        "    torch.save({'model': model.state_dict()}, path)\n"
    ) == [(6, "AMP104")]


def test_checkpoint_helper_returning_an_unknown_object_cannot_be_judged() -> None:
    assert hits(
        "import torch\n"
        "class Trainer:\n"
        "    def __init__(self):\n"
        "        self.scaler = torch.amp.GradScaler('cuda')\n"
        "    def _state(self):\n"
        "        return self.engine.collect()\n"
        "    def save(self, path):\n"
        "        torch.save(self._state(), path)\n"
    ) == []


def test_checkpoint_dataclass_of_another_file_cannot_be_judged() -> None:
    assert hits(
        "import torch\n"
        "from dataclasses import asdict\n"
        "from state import TrainState\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "def save(model, path):\n"
        "    torch.save(asdict(TrainState(model=model.state_dict())), path)\n"
    ) == []
