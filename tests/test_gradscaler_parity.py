"""The engine against ``torch.amp.GradScaler`` + ``torch.autocast`` where torch's own tests go further.

Each scenario runs twice from the same init (deepcopy) on the same data: once through the
hand-written official recipe, once through ``ampkit.MixedPrecision``; parameters are compared
bit for bit after several steps, at least one of them skipped, and so is the loss scale.
Covered: sparse gradients (``nn.Embedding(sparse=True)``), uncoalesced fp16 sparse gradients,
losses nested in lists and tuples, and custom optimizers with ``_step_supports_amp_scaling``.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from collections.abc import Callable, Sequence
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


@pytest.mark.parametrize("named", [True, False])
def test_engine_sparse_clip_error_without_prepare_names_the_parameter_or_how_to(seed, named: bool) -> None:
    model = _SparseNet()
    opt = torch.optim.SGD(model.named_parameters() if named else model.parameters(), lr=1e-3)
    mp = ampkit.MixedPrecision("fp16", device="cpu", clip_grad_norm=1.0, scaler=ampkit.DynamicLossScaler(init_scale=1.0))
    idx, y = _sparse_data(1)[0]
    with mp.autocast():
        loss = _sparse_loss(model, idx, y)
    mp.backward(loss)
    with pytest.raises(NotImplementedError) as info:
        mp.step(opt)
    message = str(info.value)
    if named:  # the optimizer's param groups carry the names
        assert "parameter 'emb.weight' has one" in message
    else:
        assert "a parameter of shape [12, 8] has one" in message
        assert "mp.prepare(model)" in message and "model.named_parameters()" in message


# -- 2. uncoalesced fp16 sparse gradients ------------------------------------------------------------------------
_IDX = torch.tensor([[0, 1, 0], [2, 0, 2]])
"""Two entries at (0, 2): torch's own sparse-unscale test.  In fp16, 32000 + 32000 fits but 64000 + 64000 does not."""


def _fp16_sparse_grad(values: list[float], scale: float) -> torch.Tensor:
    v = torch.tensor(values) * scale
    return torch.sparse_coo_tensor(_IDX, v, (2, 3), check_invariants=True).to(torch.float16)


# Per step: the unscaled values of the three (uncoalesced) entries.  After two clean steps the scale
# grows to 2**17, where step 2's duplicates (39321 each) fit fp16 but their sum does not.
_FP16_STEPS = [[0.25, 0.5, 0.125], [0.25, 0.25, 0.25], [0.3, 0.25, 0.3], [0.125, 0.25, 0.5]]
_FP16_SCALE = 2.0**16


def _unscale_allowing_fp16(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> None:
    """``GradScaler.unscale_(opt)`` line for line, but with fp16 gradients allowed.

    The public ``unscale_`` refuses fp16 gradients; torch's own test of sparse unscaling calls
    ``_unscale_grads_(..., allow_fp16=True)`` the same way.
    """
    assert scaler._scale is not None
    state = scaler._per_optimizer_states[id(opt)]
    inv_scale = scaler._scale.double().reciprocal().float()
    found_inf = torch.full((), 0.0, dtype=torch.float32)
    state["found_inf_per_device"] = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
    state["stage"] = torch.amp.grad_scaler.OptState.UNSCALED


def _fp16_param() -> torch.Tensor:
    # Not trainable through autograd: the gradient is assigned, as in torch's test (the engine refuses
    # trainable fp16 parameters under loss scaling).
    return torch.zeros(2, 3, dtype=torch.float16)


def test_engine_unscale_replaces_uncoalesced_fp16_sparse_grad(seed):
    p, q = _fp16_param(), _fp16_param()
    scaler = torch.amp.GradScaler("cpu", init_scale=_FP16_SCALE)
    scaler.scale(torch.ones(()))  # creates GradScaler's scale tensor
    ref_opt = torch.optim.SGD([q], lr=1.0)
    q.grad = _fp16_sparse_grad(_FP16_STEPS[0], _FP16_SCALE)
    _unscale_allowing_fp16(scaler, ref_opt)
    record = _Record()
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=_FP16_SCALE),
                               hooks=[record])
    p.grad = _fp16_sparse_grad(_FP16_STEPS[0], _FP16_SCALE)
    assert not p.grad.is_coalesced()
    mp.step(torch.optim.SGD([p], lr=1.0))
    grad = record.grads[0][0]
    assert grad.is_coalesced() and q.grad.is_coalesced()
    assert torch.equal(grad._indices(), q.grad._indices())
    assert torch.equal(grad._values(), q.grad._values())
    assert torch.equal(grad._values(), torch.tensor([0.25 + 0.125, 0.5], dtype=torch.float16))


def test_engine_uncoalesced_fp16_sparse_steps_match_gradscaler(seed):
    p, q = _fp16_param(), _fp16_param()
    opt, ref_opt = torch.optim.SGD([p], lr=0.5), torch.optim.SGD([q], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=_FP16_SCALE, growth_interval=GROWTH_INTERVAL)
    scaler.scale(torch.ones(()))
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(
        init_scale=_FP16_SCALE, growth_interval=GROWTH_INTERVAL, max_scale=None))
    skipped = []
    for values in _FP16_STEPS:
        q.grad = _fp16_sparse_grad(values, scaler.get_scale())
        _unscale_allowing_fp16(scaler, ref_opt)
        scaler.step(ref_opt)
        scaler.update()
        p.grad = _fp16_sparse_grad(values, float(mp.scale))
        assert torch.isfinite(p.grad._values()).all()
        skipped.append(mp.step(opt).skipped)
        assert torch.equal(p, q)
        assert float(mp.scale) == scaler.get_scale()
    assert skipped == [False, False, True, False]


# -- 3. nested outputs ---------------------------------------------------------------------------------------
Pair = namedtuple("Pair", ["a", "b"])


def _structures() -> list[Any]:
    t = [torch.tensor(float(v)) for v in (1.5, -2.0, 3.25)]
    return [t[0], [t[0], t[1]], (t[0], [t[1], (t[2],)]), ()]


@pytest.mark.parametrize("index", range(4))
def test_engine_scale_loss_returns_gradscaler_structure(seed, index):
    outputs = _structures()[index]
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=8.0))
    ours, theirs = mp.scale_loss(outputs), torch.amp.GradScaler("cpu", init_scale=8.0).scale(outputs)

    def same(a: Any, b: Any) -> None:
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)

    same(ours, theirs)


def test_engine_scale_loss_keeps_named_tuples(seed):
    # GradScaler.scale fails here (it calls Pair(map_object)); the engine rebuilds the named tuple.
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=8.0))
    ours = mp.scale_loss(Pair(torch.tensor(1.0), [torch.tensor(2.0)]))
    assert type(ours) is Pair and type(ours.b) is list
    assert float(ours.a) == 8.0 and float(ours.b[0]) == 16.0


def test_engine_scale_loss_returns_iterator_for_other_iterables(seed):
    t = [torch.tensor(1.0), torch.tensor(2.0)]
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=4.0))
    ours = mp.scale_loss(x for x in t)
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0).scale(x for x in t)
    assert iter(ours) is ours
    assert [float(x) for x in ours] == [float(x) for x in theirs] == [4.0, 8.0]


def test_engine_scale_loss_refusal_names_scale_loss(seed):
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    with pytest.raises(TypeError, match=r"mp\.scale_loss\(loss\) needs a tensor or nested") as info:
        mp.scale_loss([torch.ones(()), 2.0])
    assert "mp.backward" not in str(info.value)
    with pytest.raises(TypeError, match=r"list\(losses\.values\(\)\)"):
        mp.scale_loss({"a": torch.ones(())})
    with pytest.raises(TypeError, match=r"mp\.backward\(loss\) needs a tensor"):
        mp.backward("loss")


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 2)
        self.head_b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.head_a(h), self.head_b(h)


def _two_losses(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    a, b = model(x)
    return (a.float().pow(2).mean(), [b.float().abs().mean(), (a.float() * 3.0).sum()])


def _head_data(n: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def test_engine_backward_nested_losses_matches_gradscaler(seed):
    model, accumulation = _TwoHeads(), 2
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    scaler = _grad_scaler()
    data = _head_data()
    for i, x in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            la, (lb, lc) = _two_losses(ref, x)
        scaled = scaler.scale((la / accumulation, [lb / accumulation, lc / accumulation]))
        torch.autograd.backward([scaled[0], *scaled[1]])
        if (i + 1) % accumulation == 0:
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=accumulation, scaler=_scaler())
    skipped = []
    for x in data:
        with mp.autocast():
            losses = _two_losses(model, x)
        mp.backward(losses)
        result = mp.step(opt)
        if result.boundary:
            skipped.append(result.skipped)
    assert any(skipped) and not all(skipped), skipped
    assert float(mp.scale) == scaler.get_scale()
    _assert_same_params(model, ref)


def test_engine_backward_nested_calls_on_backward_once_per_tensor(seed):
    model = _TwoHeads()
    record = _Record()
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2, hooks=[record])
    with mp.autocast():
        la, (lb, lc) = _two_losses(model, _head_data(1)[0])
    mp.backward((la, [lb, lc]))
    assert [id(t) for t in record.losses] == [id(la), id(lb), id(lc)]


def test_engine_backward_nested_telemetry_and_doctor_record_each_loss(seed):
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    records: list[dict[str, Any]] = []
    mp = ampkit.MixedPrecision("fp16", device="cpu", telemetry=ampkit.Telemetry([records.append], flush_every=1),
                               doctor=True)
    mp.prepare(model)
    expected = []
    for x in _head_data(3):
        with mp.autocast():
            la, (lb, lc) = _two_losses(model, x)
        expected.append((la.item() + lb.item() + lc.item()) / 3)
        mp.backward((la, [lb, lc]))
        mp.step(opt)
    mp.close()
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-6)


# -- 4. custom optimizers with _step_supports_amp_scaling ----------------------------------------------------------
class _ProtocolSGD(torch.optim.Optimizer):
    """Plain SGD that implements torch's AMP attribute protocol: it reads grad_scale and found_inf."""

    honors_found_inf = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True
        self.calls: list[tuple[Any, Any]] = []

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self.calls.append((grad_scale, found_inf))
        if self.honors_found_inf and found_inf is not None and float(found_inf) > 0:
            return
        self._apply(grad_scale)

    @torch.no_grad()
    def _apply(self, grad_scale: torch.Tensor | None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad if grad_scale is None else p.grad / grad_scale
                    p.add_(g, alpha=-group["lr"])


class _IgnoresFoundInf(_ProtocolSGD):
    """Declares the protocol, unscales by grad_scale, but never looks at found_inf."""

    honors_found_inf = False


class _WantsGradScaler(_ProtocolSGD):
    """Written for GradScaler's deprecated protocol: given ``grad_scaler=``, it would unscale through it."""

    def step(self, closure: Callable[[], Any] | None = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
        self.calls.append((grad_scaler, None))
        if grad_scaler is not None:
            raise AssertionError("GradScaler's protocol is not exercised here")
        self._apply(None)  # called as a plain optimizer: the gradients are already unscaled


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _tiny_data(n: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    # Large targets: the first steps overflow fp16 at the initial scale and are skipped.
    return [(torch.randn(4, 8, generator=g), 400.0 * torch.randn(4, 4, generator=g)) for _ in range(n)]


def _tiny_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def _recipe_tiny(model: nn.Module, opt: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
                 user_scale: float | None = None) -> torch.amp.GradScaler:
    scaler = _grad_scaler()
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _tiny_loss(model, x, y)
        if user_scale is not None:
            loss = loss * user_scale
            opt.grad_scale = torch.tensor(user_scale)  # type: ignore[attr-defined]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return scaler


def _engine_tiny(model: nn.Module, opt: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
                 user_scale: float | None = None) -> tuple[ampkit.MixedPrecision, list[bool]]:
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=_scaler())
    mp.prepare(model)
    skipped = []
    for x, y in data:
        with mp.autocast():
            loss = _tiny_loss(model, x, y)
        if user_scale is not None:
            loss = loss * user_scale
            opt.grad_scale = torch.tensor(user_scale)  # type: ignore[attr-defined]
        mp.backward(loss)
        skipped.append(mp.step(opt).skipped)
    return mp, skipped


def test_engine_protocol_optimizer_matches_gradscaler(seed):
    model = _tiny()
    ref = copy.deepcopy(model)
    scaler = _recipe_tiny(ref, _ProtocolSGD(ref.parameters(), lr=1e-3), _tiny_data())
    mp, skipped = _engine_tiny(model, _ProtocolSGD(model.parameters(), lr=1e-3), _tiny_data())
    assert any(skipped) and not all(skipped), skipped
    assert float(mp.scale) == scaler.get_scale()
    _assert_same_params(model, ref)


def test_engine_skips_protocol_optimizer_that_ignores_found_inf(seed):
    model = _tiny()
    ref = copy.deepcopy(model)
    # The reference is the same optimizer honouring found_inf: what a skipped step must look like.
    scaler = _recipe_tiny(ref, _ProtocolSGD(ref.parameters(), lr=1e-3), _tiny_data())
    opt = _IgnoresFoundInf(model.parameters(), lr=1e-3)
    mp, skipped = _engine_tiny(model, opt, _tiny_data())
    assert any(skipped) and not all(skipped), skipped
    assert len(opt.calls) == skipped.count(False)
    assert all(float(found) == 0.0 for _, found in opt.calls)
    assert float(mp.scale) == scaler.get_scale()
    _assert_same_params(model, ref)


def test_engine_fused_optimizer_with_user_grad_scale_matches_gradscaler(seed):
    model = _tiny()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3, fused=True)
    scaler = _recipe_tiny(ref, ref_opt, _tiny_data(), user_scale=4.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    mp, skipped = _engine_tiny(model, opt, _tiny_data(), user_scale=4.0)
    assert any(skipped) and not all(skipped), skipped
    assert float(mp.scale) == scaler.get_scale()
    _assert_same_params(model, ref)
    assert not hasattr(opt, "grad_scale") and not hasattr(ref_opt, "grad_scale")
    assert not hasattr(opt, "found_inf") and not hasattr(ref_opt, "found_inf")


def test_engine_protocol_optimizer_gets_user_grad_scale_then_attributes_deleted(seed):
    model = _tiny()
    opt = _ProtocolSGD(model.parameters(), lr=1e-3)
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=1.0))
    x, y = _tiny_data(1)[0]
    for user_scale in (torch.tensor(4.0), None):
        with mp.autocast():
            loss = _tiny_loss(model, x, y)
        if user_scale is not None:
            opt.grad_scale = user_scale  # type: ignore[attr-defined]
        mp.backward(loss)
        mp.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert opt.calls[0][0] is not None and float(opt.calls[0][0]) == 4.0
    assert opt.calls[1][0] is None
    assert all(isinstance(found, torch.Tensor) for _, found in opt.calls)


def test_engine_refuses_grad_scaler_keyword_optimizer_before_unscaling(seed):
    model = _tiny()
    opt = _WantsGradScaler(model.parameters(), lr=1e-3)
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=8.0))
    x, y = _tiny_data(1)[0]
    with mp.autocast():
        loss = _tiny_loss(model, x, y)
    mp.backward(loss)
    scaled = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError) as info:
        mp.step(opt)
    message = str(info.value)
    assert message.startswith("_WantsGradScaler.step() takes grad_scaler=")
    assert "self.grad_scale" in message and "self.found_inf" in message
    assert "_step_supports_amp_scaling = False" in message
    assert opt.calls == []
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), scaled))


def test_engine_grad_scaler_keyword_optimizer_without_protocol_matches_gradscaler(seed):
    # The error's second fix: without _step_supports_amp_scaling, both unscale and skip for it.
    model = _tiny()
    ref = copy.deepcopy(model)
    ref_opt = _WantsGradScaler(ref.parameters(), lr=1e-3)
    opt = _WantsGradScaler(model.parameters(), lr=1e-3)
    ref_opt._step_supports_amp_scaling = opt._step_supports_amp_scaling = False
    scaler = _recipe_tiny(ref, ref_opt, _tiny_data())
    mp, skipped = _engine_tiny(model, opt, _tiny_data())
    assert any(skipped) and not all(skipped), skipped
    assert float(mp.scale) == scaler.get_scale()
    _assert_same_params(model, ref)


def test_engine_custom_protocol_optimizer_step_makes_one_host_sync(monkeypatch, seed):
    model = _tiny()
    opt = _ProtocolSGD(model.parameters(), lr=1e-3)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    x, y = _tiny_data(1)[0]
    with mp.autocast():
        loss = _tiny_loss(model, x, y)
    mp.backward(loss)
    calls: list[str] = []
    original = torch.Tensor.item

    def counting_item(self: torch.Tensor) -> Any:
        calls.append("item")
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    mp.step(opt)
    assert calls == ["item"]
