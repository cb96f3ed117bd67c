from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit.policy import is_kept, keep_fp32, release_fp32, resolve_keep_fp32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ff = nn.Linear(8, 8)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = self.ff(h)
        self.seen["ff_out"] = out.dtype
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def test_policy_resolves_patterns_and_types_in_model_order() -> None:
    net = Net()
    assert resolve_keep_fp32(net, ["lm_head", "blocks.*.norm"]) == ["blocks.0.norm", "blocks.1.norm", "lm_head"]
    assert resolve_keep_fp32(net, [nn.LayerNorm]) == ["blocks.0.norm", "blocks.1.norm"]


def test_policy_unmatched_pattern_names_close_modules() -> None:
    with pytest.raises(ValueError, match=r"'lm_haed' matches no module.*lm_head"):
        resolve_keep_fp32(Net(), ["lm_haed"])


def test_policy_bad_rule_type_explains() -> None:
    with pytest.raises(TypeError, match="neither a name pattern"):
        resolve_keep_fp32(Net(), [42])  # type: ignore[list-item]


def test_policy_kept_module_runs_fp32_while_the_rest_stays_in_autocast() -> None:
    net = Net()
    mp = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["blocks.0", "lm_head"])
    mp.prepare(net)
    with mp.autocast():
        out = net(torch.randn(2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.float32, "lm_head is kept: its matmul runs in fp32"
    assert net.blocks[0].seen["ff_out"] == torch.float32, "blocks.0 is kept"
    assert net.blocks[1].seen["ff_out"] == torch.bfloat16, "blocks.1 is not kept: still autocast"


def test_policy_matches_fp32_reference_numerics_for_kept_module() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    reference = lin(x)
    ampkit.keep_fp32(lin)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = lin(x.bfloat16())
    torch.testing.assert_close(kept, lin(x.bfloat16().float()))
    assert kept.dtype == torch.float32 and reference.dtype == torch.float32


def test_policy_restores_autocast_after_forward_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    boom = ampkit.keep_fp32(Boom())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            boom(torch.ones(1))
        assert torch.is_autocast_enabled("cpu"), "autocast must be back on after the failed forward"


def test_policy_release_removes_hooks() -> None:
    lin = ampkit.keep_fp32(nn.Linear(4, 4))
    release_fp32(lin)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16


def test_policy_custom_fwd_on_whole_forward_disables_autocast_for_every_submodule() -> None:
    """The seed-style pattern (custom_fwd on a parent's forward) runs children in fp32 too; keep_fp32 does not."""

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.proj = nn.Linear(8, 8)

        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(self, x):
            return self.proj(self.norm(x))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Parent()(torch.randn(2, 8)).dtype == torch.float32  # proj lost autocast
    net = Net()
    ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["*.norm"]).prepare(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(2, 8))
    assert net.blocks[0].seen["ff_out"] == torch.bfloat16  # only the norm left autocast


def test_keep_fp32_survives_deepcopy_and_each_copy_is_released_alone() -> None:
    # An EMA or best-model copy of a model with kept modules: the copy keeps them in fp32 too, and
    # releasing one model's module leaves the other's hooks in place.
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    keep_fp32(model[1], "cpu")
    twin = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == twin(x).dtype == torch.float32
    release_fp32(twin[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32 and twin(x).dtype == torch.bfloat16


def test_policy_second_engine_refuses_a_model_whose_modules_another_engine_keeps() -> None:
    net = Net()
    first = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["blocks.0"])
    first.prepare(net)
    second = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["lm_head"])
    with pytest.raises(ValueError, match=r"(?s)\['blocks\.0'\] .*keep_fp32=\['blocks\.0'\] of another engine.*"
                                         r"keep_fp32=\['lm_head'\].*\.release\(model\)"):
        second.prepare(net)
    assert not is_kept(net.lm_head), "the refused prepare changed nothing"
    first.release(net)
    second.prepare(net)
    with second.autocast():
        net(torch.randn(2, 8))
    assert net.blocks[0].seen["ff_out"] == torch.bfloat16, "the first engine's hooks are gone"


def test_policy_same_rules_or_same_engine_prepare_again_as_before() -> None:
    net = Net()
    keep_fp32(net.blocks[1].norm, "cpu")  # kept by hand: no engine's business
    first = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["blocks.0"])
    first.prepare(net)
    first.prepare(net)
    again = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=["blocks.*"])  # keeps blocks.0 too
    again.prepare(net)
    again.release(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(2, 8))
    assert net.blocks[0].seen["ff_out"] == torch.bfloat16, "the engine that prepared last released blocks.0"
    assert is_kept(net.blocks[1].norm), "a module kept by hand stays kept"
