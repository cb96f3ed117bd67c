"""The built-in tinygpt task: real text from the interpreter's standard library, deterministic streams."""

from __future__ import annotations

import torch

from ampkit._util.digest import state_sha256
from ampkit.tasks.tinygpt import HOLDOUT_EVERY, TinyGPTTask, stdlib_corpus
from ampkit.verify.worker import data_sha256


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
