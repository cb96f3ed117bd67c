"""The built-in tasks: real data from the interpreter and scikit-learn, deterministic streams."""

from __future__ import annotations

import sys

import pytest
import torch

from ampkit.tasks import digits as digits_module
from ampkit.tasks.tinygpt import HOLDOUT_EVERY, TinyGPTTask, stdlib_corpus
from ampkit.verify.task import TaskLoadError, load_task
from ampkit.verify.worker import data_sha256, state_sha256


def test_tinygpt_corpus_holds_out_every_eighth_stdlib_file() -> None:
    corpus = stdlib_corpus()
    names = sorted(p.name for p in corpus.train_files + corpus.eval_files)
    assert [p.name for p in corpus.eval_files] == names[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY]
    assert not set(corpus.train_files) & set(corpus.eval_files)
    assert "os.py" in names and corpus.train.numel() > 1_000_000


def test_tinygpt_same_seed_same_weights_and_batches() -> None:
    task = TinyGPTTask(d_model=32, n_layer=1, n_head=2, block_size=16, batch_size=2)
    cpu = torch.device("cpu")
    assert state_sha256(task.build_model(3)) == state_sha256(task.build_model(3))
    assert state_sha256(task.build_model(3)) != state_sha256(task.build_model(4))
    assert data_sha256(task, 3, cpu, 3) == data_sha256(task, 3, cpu, 3) != data_sha256(task, 4, cpu, 3)
    x, y = next(iter(task.batches(3, cpu)))
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_tinygpt_untrained_model_scores_about_eight_bits_per_byte() -> None:
    task = TinyGPTTask(d_model=32, n_layer=1, n_head=2, block_size=32, batch_size=4, eval_windows=8)
    model = task.build_model(0)
    with torch.no_grad():
        bpb = task.evaluate(model, torch.device("cpu"))["bits_per_byte"]
    assert abs(bpb - 8.0) < 0.2  # uniform over 256 bytes is exactly 8 bits


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
