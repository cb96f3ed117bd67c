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


def test_checkpoint_dict_built_by_a_helper_function_of_the_file() -> None:
    assert hits(
        "import torch\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "def make_checkpoint(model, opt):\n"
        "    return {'model': model.state_dict(), 'optimizer': opt.state_dict()}\n"
        "def train(model, opt, path):\n"
        "    ckpt = make_checkpoint(model, opt)\n"
        "    torch.save(ckpt, path)\n"
    ) == [(7, "AMP104")]


def test_checkpoint_dict_saved_by_a_helper_is_reported_where_it_is_built() -> None:
    source = (
        "import torch\n"
        "def save(state, path):\n"
        "    torch.save(state, path)\n"
        "def train(model, opt, path):\n"
        "    scaler = torch.amp.GradScaler('cuda')\n"
        "    save({'model': model.state_dict(), 'optimizer': opt.state_dict()}, path)\n"
        "    save({'model': model.state_dict(), 'scaler': scaler.state_dict()}, path)\n"
        "def evaluate(model, path):\n"
        "    save({'model': model.state_dict()}, path)  # no scaler visible here\n"
    )
    assert hits(source) == [(6, "AMP104")]
