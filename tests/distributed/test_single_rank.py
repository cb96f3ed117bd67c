"""The library on a one-rank gloo group inside the test process: numerics, sharding, checkpoints."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import ampkit
import ampkit.distributed as ad
from ampkit.checkpoint import CheckpointError


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def seeded():
    torch.manual_seed(1234)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _train(model, mp, opt, steps, start=0, nan_at=None):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        with mp.autocast():
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        if step == nan_at:
            loss = loss * float("nan")
        mp.backward(loss)
        result = mp.step(opt)
    return result


def test_distributed_setup_leaves_single_process_numerics_bitwise_unchanged(seeded):
    plain = Tiny()
    reduced = copy.deepcopy(plain)
    for model, use_setup in ((plain, False), (reduced, True)):
        mp = ampkit.MixedPrecision("bf16", device="cpu", clip_grad_norm=1.0)
        if use_setup:
            ad.setup(mp)
        _train(model, mp, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), steps=5, nan_at=2)
    for (name, a), b in zip(plain.named_parameters(), reduced.parameters()):
        assert torch.equal(a, b), name


def test_distributed_context_names_the_nonfinite_rank(seeded):
    model = Tiny()
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    ctx = ad.setup(mp)
    assert mp.reduces_found_inf and ctx.reduces_found_inf and mp.hooks[0] is ctx
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = _train(model, mp, opt, steps=1, nan_at=0)
    assert result.skipped and bool(ctx.loss_nonfinite)
    assert ctx.first_nonfinite_rank() == 0 and ctx.nonfinite_ranks() == [0]
    result = _train(model, mp, opt, steps=1, start=1)
    assert result.applied and ctx.first_nonfinite_rank() is None
    assert ad.first_nonfinite_rank(torch.ones(())) == 0 and ad.first_nonfinite_rank(False) is None


def test_distributed_setup_again_replaces_the_previous_context():
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    first = ad.setup(mp)
    second = ad.setup(mp, reduce_found_inf=False)
    assert mp.hooks.count(second) == 1 and first not in mp.hooks
    assert not mp.reduces_found_inf and not second.reduces_found_inf


def test_distributed_shard_gathers_kept_modules_in_fp32_and_blocks_in_bf16(seeded):
    model = Tiny()
    mp = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["blocks.*.0"])
    ad.shard(model, mp)
    mp.prepare(model)
    seen: dict[str, torch.dtype] = {}

    def record(name):
        def hook(module, args):
            seen[name] = next(module.parameters()).dtype  # the all-gathered compute weights
        return hook

    for name, module in model.named_modules():
        if isinstance(module, (nn.LayerNorm, nn.Linear)):
            module.register_forward_pre_hook(record(name))
    with mp.autocast():
        model(torch.randn(2, 8)).float().sum().backward()
    assert seen["blocks.0.0"] == seen["blocks.1.0"] == torch.float32  # kept in fp32: own FSDP unit
    assert seen["blocks.0.1"] == seen["head"] == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded masters stay fp32


def test_distributed_shard_rejects_blocks_outside_the_model():
    model = Tiny()
    with pytest.raises(ValueError, match="not sub-modules"):
        ad.shard(model, "bf16", blocks=[nn.Linear(2, 2)])


def _fsdp(seed: int):
    torch.manual_seed(seed)
    model = Tiny()
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    ad.shard(model, mp)
    ad.setup(mp)
    return model, mp, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _params(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def test_distributed_checkpoint_overwrite_replaces_and_leaves_no_leftovers(tmp_path):
    model, mp, opt = _fsdp(0)
    _train(model, mp, opt, steps=2)
    ad.save_distributed_checkpoint(tmp_path / "ck", model=model, optimizer=opt, engine=mp, extra={"step": 2})
    _train(model, mp, opt, steps=2, start=2)
    ad.save_distributed_checkpoint(tmp_path / "ck", model=model, optimizer=opt, engine=mp, extra={"step": 4})
    expected = _params(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh, fresh_mp, fresh_opt = _fsdp(99)
    extra = ad.load_distributed_checkpoint(tmp_path / "ck", model=fresh, optimizer=fresh_opt, engine=fresh_mp)
    assert extra == {"step": 4} and fresh_mp.optimizer_steps == 4
    assert all(torch.equal(expected[n], p) for n, p in _params(fresh).items())


def test_distributed_checkpoint_refused_mid_accumulation_window(tmp_path):
    model = Tiny()
    mp = ampkit.MixedPrecision("bf16", device="cpu", grad_accumulation=2)
    ad.setup(mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, mp, opt, steps=1)
    for save in (ad.save_distributed_checkpoint, ad.save_ddp_checkpoint):
        with pytest.raises(CheckpointError, match="accumulation window"):
            save(tmp_path / "ck", model=model, optimizer=opt, engine=mp)
    assert not any(tmp_path.iterdir())


def test_distributed_checkpoint_missing_names_the_interrupted_save(tmp_path):
    (tmp_path / ".ck.partial").mkdir()
    model, mp, opt = _fsdp(0)
    with pytest.raises(CheckpointError, match=r"\.ck\.partial"):
        ad.load_distributed_checkpoint(tmp_path / "ck", model=model, optimizer=opt, engine=mp)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_distributed_checkpoint_refuses_code_in_dcp_metadata(tmp_path, monkeypatch):
    model, mp, opt = _fsdp(0)
    ad.save_distributed_checkpoint(tmp_path / "ck", model=model, optimizer=opt, engine=mp)
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"global (os|posix)\.system is not allowed"):
        ad.load_distributed_checkpoint(tmp_path / "ck", model=model, optimizer=opt, engine=mp)
    assert not Path("pwned").exists()


def test_distributed_ddp_checkpoint_round_trip_and_foreign_file(tmp_path):
    torch.manual_seed(5)
    model = nn.parallel.DistributedDataParallel(Tiny())
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    ad.setup(mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, mp, opt, steps=2)
    ad.save_ddp_checkpoint(tmp_path / "ddp.pt", model=model, optimizer=opt, engine=mp, extra={"note": "x"})
    rng_after_save = torch.rand(3)
    torch.manual_seed(77)
    extra = ad.load_ddp_checkpoint(tmp_path / "ddp.pt", model=model, optimizer=opt, engine=mp)
    assert extra == {"note": "x"}  # the per-rank RNG entry is not the caller's business
    assert torch.equal(torch.rand(3), rng_after_save)
    ampkit.save_checkpoint(tmp_path / "plain.pt", model=model, optimizer=opt, engine=mp)
    with pytest.raises(CheckpointError, match="restore_rng=False"):
        ad.load_ddp_checkpoint(tmp_path / "plain.pt", model=model, optimizer=opt, engine=mp)


def test_distributed_ddp_checkpoint_failure_on_a_rank_is_raised_as_checkpoint_error(tmp_path):
    model = nn.parallel.DistributedDataParallel(Tiny())
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    ad.setup(mp)
    with pytest.raises(CheckpointError, match=r"failed on 1 rank\(s\):\n  rank 0: TypeError: .*set"):
        ad.save_ddp_checkpoint(tmp_path / "ddp.pt", model=model, engine=mp, extra={"tags": {"a", "b"}})
    assert not any(tmp_path.iterdir())
