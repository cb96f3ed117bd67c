"""The built-in digits task: scikit-learn's bundled images, and the install hint without scikit-learn."""

from __future__ import annotations

import sys

import pytest
import torch

from ampkit.tasks import TaskLoadError, load_task
from ampkit.tasks import digits as digits_module


def test_digits_task_trains_and_reports_accuracy() -> None:
    task = load_task("digits")
    model = task.build_model(0)
    opt = task.build_optimizer(model)
    stream = task.batches(0, torch.device("cpu"))
    before = task.evaluate(model, torch.device("cpu"))
    for _ in range(30):
        loss = task.loss(model, next(stream))
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = task.evaluate(model, torch.device("cpu"))
    assert task.metrics["accuracy"] == "higher" and 0.0 <= before["accuracy"] <= 1.0
    assert after["accuracy"] > max(0.5, before["accuracy"]) and set(after) == {"accuracy"}


def test_digits_without_scikit_learn_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    digits_module.load_digits_tensors.cache_clear()
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what Python sees when the package is absent
    try:
        with pytest.raises(TaskLoadError, match=r"pip install 'ampkit\[digits\]'"):
            load_task("digits")
    finally:
        digits_module.load_digits_tensors.cache_clear()
