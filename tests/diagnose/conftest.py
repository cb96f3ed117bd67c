"""Fixtures of the doctor tests: a fixed seed for every test, and a spy on replay seeds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ampkit.diagnose.step.programs import OutputGradProgram


@pytest.fixture(autouse=True)
def seed() -> int:
    torch.manual_seed(0)
    return 0


@pytest.fixture
def replay_seeds(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The output gradients every op-level replay is seeded with, one list per replayed call."""
    seeds: list[list[Any]] = []
    original = OutputGradProgram.__init__

    def spy(self: OutputGradProgram, args: tuple, kwargs: dict[str, Any], grads: Any, **rest: Any) -> None:
        seeds.append(list(grads))
        original(self, args, kwargs, grads, **rest)

    monkeypatch.setattr(OutputGradProgram, "__init__", spy)
    return seeds
