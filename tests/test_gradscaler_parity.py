"""The engine against ``torch.amp.GradScaler`` + ``torch.autocast`` where torch's own tests go further.

Each scenario runs twice from the same init (deepcopy) on the same data: once through the
hand-written official recipe, once through ``ampkit.MixedPrecision``; parameters are compared
bit for bit after several steps, at least one of them skipped, and so is the loss scale.
Covered: sparse gradients (``nn.Embedding(sparse=True)``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from typing_extensions import override

import ampkit
from ampkit.hooks import EngineHook

INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2


def _scaler() -> ampkit.DynamicLossScaler:
    # max_scale=None: GradScaler has no cap, so neither may the engine for the scales to match.
    return ampkit.DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, max_scale=None)


def _grad_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def _assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name!r} differs from the GradScaler recipe"


class _Record(EngineHook):
    """Keeps a copy of each gradient right after the engine unscaled it, and every loss it is shown."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    @override
    def on_backward(self, engine: Any, loss: torch.Tensor) -> None:
        self.losses.append(loss)

    @override
    def after_unscale(self, engine: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.grads.append([p.grad.clone() for o in optimizers for g in o.param_groups for p in g["params"]
                           if p.grad is not None])


# -- 1. sparse gradients -----------------------------------------------------------------------------------
class _SparseNet(nn.Module):
    """A sparse embedding (its gradient is an uncoalesced sparse tensor) feeding a Linear (fp16 in autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8, sparse=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


def _sparse_data(n: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    # Repeated indices, so the embedding gradient holds duplicates; the large targets overflow fp16
    # at the first scales, so the first steps are skipped and the scale backs off.
    return [(torch.randint(0, 6, (16,), generator=g), 300.0 * torch.randn(16, 4, generator=g)) for _ in range(n)]


def _sparse_loss(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(idx).float() - y).pow(2).mean()


def _recipe_sparse(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.amp.GradScaler, list[bool]]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = _grad_scaler()
    skipped = []
    for idx, y in data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _sparse_loss(model, idx, y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
    return scaler, skipped


def test_engine_sparse_embedding_matches_gradscaler(seed):
    model = _SparseNet()
    ref = copy.deepcopy(model)
    data = _sparse_data()
    scaler, ref_skipped = _recipe_sparse(ref, data)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=_scaler())
    mp.prepare(model)
    skipped = []
    for idx, y in data:
        with mp.autocast():
            loss = _sparse_loss(model, idx, y)
        mp.backward(loss)
        skipped.append(mp.step(opt).skipped)
    assert any(skipped) and not all(skipped), skipped
    assert skipped == ref_skipped
    assert float(mp.scale) == scaler.get_scale()
    _assert_same_params(model, ref)


def test_engine_sparse_grad_norm_is_norm_of_dense_gradient(seed):
    model = _SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    record = _Record()
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=1.0), hooks=[record])
    idx, y = _sparse_data(1)[0]
    with mp.autocast():
        loss = _sparse_loss(model, idx, y)
    mp.backward(loss)
    result = mp.step(opt)
    grads = record.grads[0]
    assert grads[0].is_sparse and not grads[0].is_coalesced()
    dense = torch.cat([g.to_dense().reshape(-1) for g in grads])
    assert result.grad_norm is not None
    torch.testing.assert_close(result.grad_norm, torch.linalg.vector_norm(dense))


def test_torch_clip_grad_norm_has_no_sparse_norm(seed):
    model = _SparseNet()
    idx, y = _sparse_data(1)[0]
    _sparse_loss(model, idx, y).backward()
    with pytest.raises(NotImplementedError, match="linalg_vector_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=None)


def test_engine_refuses_clipping_sparse_gradients_and_clips_nothing(seed):
    model = _SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mp = ampkit.MixedPrecision("fp16", device="cpu", clip_grad_norm=1.0, scaler=ampkit.DynamicLossScaler(init_scale=1.0))
    mp.prepare(model)
    before = copy.deepcopy(model)
    idx, y = _sparse_data(1)[0]
    with mp.autocast():
        loss = _sparse_loss(model, idx, y)
    mp.backward(loss)
    unclipped = model.fc.weight.grad.clone()
    with pytest.raises(NotImplementedError) as info:
        mp.step(opt)
    message = str(info.value)
    assert "clip_grad_norm=1.0" in message and "'emb.weight'" in message
    assert "clip_grad_norm=None" in message and "sparse=False" in message
    assert torch.equal(model.fc.weight.grad, unclipped)
    _assert_same_params(model, before)
