"""Telemetry of models with sparse gradients (``nn.Embedding(sparse=True)``): every record is that of
the dense gradient the sparse one stands for (duplicate indices summed), on every step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit.telemetry import Telemetry
from ampkit.telemetry.metrics import GradCounter
from ampkit.verify.worker import run


class SparseModel(nn.Module):
    """A sparse embedding (rows 5-9 never indexed: zero gradients) feeding a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx) * poison)


class DenseGrads(ampkit.EngineHook):
    """The dense form of each step's gradients as the optimizer sees them (sparse: coalesced, densified)."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def before_optimizer_step(self, engine: ampkit.MixedPrecision, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.grads.append([(p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad).clone()
                           for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None])


def _train(precision: str, steps: int, *, poisoned_step: int = 0) -> tuple[list[dict], DenseGrads]:
    model, capture, records = SparseModel(), DenseGrads(), []
    tel = Telemetry(sinks=[records.append], flush_every=3, alarms=(), zero_grads_every=2, module_absmax_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision(precision, device="cpu", hooks=[capture], telemetry=tel)
    mp.prepare(model)
    for step in range(1, steps + 1):
        idx = torch.tensor([1, 3, 3, 4, 1, 1])  # duplicates: the sparse gradient is not coalesced
        poison = torch.ones(4)
        if step == poisoned_step:
            poison[1] = math.inf  # embedding gradient column 1 of each indexed row becomes inf (or NaN)
        with mp.autocast():
            loss = model(idx, poison).float().pow(2).mean()
        mp.backward(loss)
        mp.step(opt)
    tel.close()
    return records, capture


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_telemetry_sparse_gradients_records_match_the_dense_gradients(precision: str) -> None:
    records, capture = _train(precision, steps=4)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r, grads in zip(records, capture.grads):
        assert r["nonfinite_grads"] == 0 and not r["skipped"]
        norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-5)
        emb, weight, bias = grads
        assert r["module_grad_absmax"] == pytest.approx(
            {"emb": float(emb.abs().max()), "head": max(float(weight.abs().max()), float(bias.abs().max()))}, rel=1e-6)
        if r["step"] % 2 == 1:  # zero_grads_every=2: steps 1, 3
            zeros = sum(int((g == 0).sum()) for g in grads)
            assert r["zero_grad_fraction"] == zeros / sum(g.numel() for g in grads) > 0
        else:
            assert r["zero_grad_fraction"] is None


def test_telemetry_sparse_gradients_nonfinite_count_on_a_step_without_the_zero_count() -> None:
    records, capture = _train("bf16", steps=4, poisoned_step=2)
    expected = [sum(int((~torch.isfinite(g)).sum()) for g in grads) for grads in capture.grads]
    assert expected[1] > 0 and expected[0] == expected[2] == expected[3] == 0
    assert [r["nonfinite_grads"] for r in records] == expected
    assert [r["skipped"] for r in records] == [False, True, False, False]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_gradcounter_counts_a_sparse_csr_gradient_through_its_values() -> None:
    dense = torch.tensor([[0.0, 2.0, 0.0], [math.inf, 0.0, math.nan]])
    zeros, nonfinite = GradCounter(torch.device("cpu")).count([dense.to_sparse_csr(), torch.tensor([0.0, 1.0])])
    assert (int(zeros), int(nonfinite)) == (3 + 1, 2)


_TASK = '''
import torch
from torch import nn
from ampkit.tasks import TaskBase


class SparseEmbeddingTask(TaskBase):
    name, metrics, samples_per_batch = "sparse-embedding", {"mse": "lower"}, 8
    default_steps, default_warmup, default_eval_every = 4, 1, 4

    def build_model(self, seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Embedding(16, 4, sparse=True), nn.Linear(4, 1))

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def batches(self, seed, device):
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randint(0, 16, (8,), generator=g).to(device)

    def loss(self, model, batch):
        return model(batch).float().pow(2).mean()

    def evaluate(self, model, device):
        return {"mse": float(model(torch.arange(16, device=device)).float().pow(2).mean())}
'''


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_verify_worker_trains_a_task_with_a_sparse_embedding(precision: str, tmp_path: Path) -> None:
    # The worker of `ampkit verify` (one precision's run, in this process): it always records telemetry.
    task = tmp_path / "sparse_task.py"
    task.write_text(_TASK)
    spec = {"task": f"{task}:SparseEmbeddingTask", "precision": precision, "device": "cpu", "steps": 4, "warmup": 1,
            "seed": 0, "eval_every": 4, "result": str(tmp_path / "result.json"), "size": None}
    result = run(spec)
    assert (result["status"], result["error"]) == ("ok", None)
    assert [r["step"] for r in result["steps"]] == [1, 2, 3, 4]
