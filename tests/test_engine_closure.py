"""Engine and closures: a closure, or an optimizer that needs one (LBFGS), is refused before anything moves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import ampkit
from tests.helpers.models import TinyNet, make_batches


def _snapshot(mp, model, opt):
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "params": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "engine": copy.deepcopy(mp.state_dict()),
    }


def _assert_same(before, after) -> None:
    assert before["grads"].keys() == after["grads"].keys()
    for name, grad in before["grads"].items():
        assert torch.equal(grad, after["grads"][name]), f"gradient of {name} changed"
    for name, value in before["params"].items():
        assert torch.equal(value, after["params"][name]), f"parameter {name} changed"
    assert repr(before["opt"]) == repr(after["opt"]), "optimizer state changed"
    assert repr(before["engine"]) == repr(after["engine"]), "engine state (scaler, step counts) changed"


def _backward(mp, model, seed):
    x, y = make_batches(1, seed=seed)[0]
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_engine_step_refuses_lbfgs_before_touching_anything(precision, accumulation, seed) -> None:
    model = TinyNet()
    opt = torch.optim.LBFGS(model.parameters())
    mp = ampkit.MixedPrecision(precision, device="cpu", grad_accumulation=accumulation, clip_grad_norm=1e-3)
    _backward(mp, model, seed)
    before = _snapshot(mp, model, opt)
    with pytest.raises(TypeError, match=r"mp.step\(LBFGS\).*needs a closure.*re-evaluates the loss.*opt.step\(closure\)"):
        mp.step(opt)
    _assert_same(before, _snapshot(mp, model, opt))
    assert mp.micro_step == 0 and mp.optimizer_steps == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_engine_step_refuses_closure_before_touching_anything(precision, seed) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1e-3)
    _backward(mp, model, seed)
    before = _snapshot(mp, model, opt)
    calls = []
    with pytest.raises(TypeError, match=r"mp.step\(optimizer, closure\) is not supported.*loss scaling"):
        mp.step(opt, lambda: calls.append(1))
    assert not calls, "the closure must not run"
    _assert_same(before, _snapshot(mp, model, opt))
    # The refused call moved nothing: the same step then runs normally.
    assert mp.step(opt).applied


def test_requires_closure_reads_the_step_signature() -> None:
    from ampkit.engine._guards import requires_closure

    params = [torch.nn.Parameter(torch.zeros(1))]
    assert requires_closure(torch.optim.LBFGS(params))
    assert not requires_closure(torch.optim.SGD(params, lr=0.1))
    assert not requires_closure(torch.optim.AdamW(params))
