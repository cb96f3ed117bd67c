"""The training snippet most AMP guides still show must give exactly AMP101 (deprecated API), and
AMP113 only when the checkpoint is loaded with a bare ``torch.load``: nothing else in it is wrong."""

from __future__ import annotations

from ampkit.lint import lint_source
from ampkit.lint.fix import fix_source

GUIDE_SNIPPET = '''\
import torch
import torch.nn as nn
import torch.optim as optim
from torch.cuda.amp import GradScaler, autocast

model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
scaler = GradScaler()

for epoch in range(10):
    for inputs, target in data:
        optimizer.zero_grad()
        with autocast():
            output = model(inputs)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
torch.save(checkpoint, "checkpoint.pt")

checkpoint = torch.load("checkpoint.pt"{load_args})
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])
scaler.load_state_dict(checkpoint["scaler"])
'''


def _codes(source: str) -> list[tuple[int, str]]:
    return [(v.line, v.code) for v in lint_source(source)]


def test_seed_snippet_safe_load_gives_exactly_amp101() -> None:
    source = GUIDE_SNIPPET.replace("{load_args}", ", weights_only=True")
    assert _codes(source) == [(9, "AMP101"), (14, "AMP101")]


def test_seed_snippet_bare_load_adds_amp113() -> None:
    source = GUIDE_SNIPPET.replace("{load_args}", "")
    assert _codes(source) == [(9, "AMP101"), (14, "AMP101"), (24, "AMP113")]


def test_seed_snippet_without_scaler_in_checkpoint_adds_amp104() -> None:
    source = GUIDE_SNIPPET.replace("{load_args}", ", weights_only=True").replace(
        ', "scaler": scaler.state_dict()}', "}")
    assert _codes(source) == [(9, "AMP101"), (14, "AMP101"), (22, "AMP104")]


def test_seed_snippet_after_fix_only_the_load_remains() -> None:
    source = GUIDE_SNIPPET.replace("{load_args}", "")
    fixed, count = fix_source(source)
    assert count == 2
    assert "from torch.amp import GradScaler, autocast" in fixed
    assert 'scaler = GradScaler("cuda")' in fixed and 'with autocast("cuda"):' in fixed
    assert _codes(fixed) == [(24, "AMP113")]
