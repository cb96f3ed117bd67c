"""fp8 precision names, the layer filter, the refused combinations and the saved states."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import ampkit
from ampkit.fp8 import check_fp8_filter, fp8_candidates
from ampkit.precision import Precision, PrecisionError

pytest.importorskip("torchao")

pytestmark = pytest.mark.filterwarnings("ignore:precision='fp8.*no fp8 GEMM:UserWarning")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 48)


ALL = ["blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.attn", "blocks.1.mlp.0", "blocks.1.mlp.2", "lm_head"]
FP8 = Precision.parse("fp8", "cpu")


@pytest.mark.parametrize(("spelling", "name", "recipe"), [
    ("fp8", "fp8", "tensorwise"), ("FP8", "fp8", "tensorwise"), ("fp8-tensorwise", "fp8", "tensorwise"),
    ("fp8-rowwise", "fp8-rowwise", "rowwise"), ("fp8-rowwise-gw-hp", "fp8-rowwise-gw-hp", "rowwise_with_gw_hp"),
])
def test_precision_parse_fp8_names_are_bf16_autocast_without_loss_scaling(spelling: str, name: str, recipe: str) -> None:
    p = Precision.parse(spelling, device="cpu")
    assert (p.name, p.fp8_recipe, p.dtype, p.autocast_enabled, p.needs_loss_scaling, p.is_fp8) == (
        name, recipe, torch.bfloat16, True, False, True)


def test_precision_parse_fp8_on_mps_or_xpu_is_refused_naming_the_devices() -> None:
    with pytest.raises(PrecisionError, match="runs on cuda .* and on cpu"):
        Precision._check("fp8", torch.device("xpu"))


def test_fp8_candidates_default_takes_every_linear_with_dims_multiple_of_16() -> None:
    model = Net()
    model.blocks[1].mlp[2] = nn.Linear(64, 40)
    assert fp8_candidates(model, FP8) == [n for n in ALL if n != "blocks.1.mlp.2"]


def test_fp8_candidates_keep_fp32_excludes_the_module_and_everything_below_it() -> None:
    assert fp8_candidates(Net(), FP8, keep_fp32=["blocks.0", "lm_head"]) == ALL[3:6]


def test_fp8_candidates_filter_patterns_and_types_keep_layers_out() -> None:
    assert fp8_candidates(Net(), FP8, fp8_filter=["*.attn", "lm_head"]) == [n for n in ALL if "attn" not in n][:-1]
    assert fp8_candidates(Net(), FP8, fp8_filter=[nn.Sequential]) == ["blocks.0.attn", "blocks.1.attn", "lm_head"]


def test_fp8_candidates_callable_decides_like_torchao_module_filter_fn() -> None:
    seen = []

    def only_mlp(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return ".mlp." in fqn

    assert fp8_candidates(Net(), FP8, fp8_filter=only_mlp) == [n for n in ALL if ".mlp." in n]
    assert seen == ALL


def test_fp8_candidates_auto_converts_nothing_on_a_small_model() -> None:
    assert fp8_candidates(Net(), FP8, fp8_filter="auto") == []
    big = nn.Sequential(nn.Linear(4096, 2048))
    assert fp8_candidates(big, FP8, fp8_filter="auto") == ["0"]


def test_fp8_candidates_auto_for_rowwise_gw_hp_takes_rowwise_size_rules() -> None:
    # (in, out) = (2048, 4096): big enough for tensorwise's rules, not for rowwise's; (4096, 4096): for both.
    # On the meta device: the rules read only the weight's shape.
    model = nn.Sequential(nn.Linear(2048, 4096, device="meta"), nn.Linear(4096, 4096, device="meta"))
    chosen = {p: fp8_candidates(model, Precision.parse(p, "cpu"), fp8_filter="auto")
              for p in ("fp8", "fp8-rowwise", "fp8-rowwise-gw-hp")}
    assert chosen == {"fp8": ["0", "1"], "fp8-rowwise": ["1"], "fp8-rowwise-gw-hp": ["1"]}


@pytest.mark.parametrize(("value", "error", "match"), [
    ("lm_head", ValueError, r"only string accepted is 'auto'.*fp8_filter=\['lm_head'\]"),
    (nn.Linear, TypeError, r"a type must be inside a list \(fp8_filter=\[Linear\]\)"),
    (3, TypeError, r"fp8_filter=3 \(int\) is not a filter"),
    (["lm_head", 3], TypeError, r"fp8_filter\[1\]=3 is neither"),
])
def test_fp8_filter_bad_values_name_the_value_and_the_valid_forms(value, error, match) -> None:
    with pytest.raises(error, match=match) as info:
        check_fp8_filter(value)
    assert "Valid forms" in str(info.value) and "'auto'" in str(info.value)


def test_fp8_filter_pattern_matching_nothing_names_the_closest_modules() -> None:
    with pytest.raises(ValueError, match=r"fp8_filter pattern 'lm_haed' matches no module.*lm_head"):
        fp8_candidates(Net(), FP8, fp8_filter=["lm_haed"])


def test_fp8_filter_with_another_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8_filter chooses the Linear layers that fp8 converts"):
        ampkit.MixedPrecision("bf16", device="cpu", fp8_filter=["lm_head"])


def test_fp8_engine_filter_is_part_of_the_description() -> None:
    mp = ampkit.MixedPrecision("fp8-rowwise", device="cpu", fp8_filter=["lm_head"])
    assert mp.config.describe()["fp8_filter"] == ["lm_head"]
    assert "fp8_filter" not in ampkit.MixedPrecision("bf16", device="cpu").config.describe()
    model = mp.prepare(Net())
    assert mp.fp8.layers == ALL[:-1] and type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("scaler", ["dynamic", "static"])
def test_fp8_engine_refuses_an_enabled_loss_scaler_and_says_why(scaler: str) -> None:
    with pytest.raises(ValueError, match="fp8 training takes no loss scaler. torchao scales every fp8 tensor itself"):
        ampkit.MixedPrecision("fp8", device="cpu", scaler=scaler)


def test_fp8_engine_accepts_scaler_none() -> None:
    assert not ampkit.MixedPrecision("fp8", device="cpu", scaler="none").scaler.enabled


def test_fp8_engine_without_torchao_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # how Python marks a package as not importable
    with pytest.raises(ImportError, match=r"pip install 'ampkit\[fp8\]'"):
        ampkit.MixedPrecision("fp8", device="cpu")


@pytest.mark.filterwarnings("default")
def test_fp8_engine_on_cpu_warns_that_the_kernels_are_slow() -> None:
    with pytest.warns(UserWarning, match=r"on the CPU: there is no fp8 GEMM here.*CPU _scaled_mm.*slower") as record:
        ampkit.MixedPrecision("fp8", device="cpu")
    assert record[0].filename == __file__, "the warning names the user's line"


def test_fp8_engine_state_records_the_canonical_precision() -> None:
    assert ampkit.MixedPrecision("fp8-tensorwise", device="cpu").state_dict()["precision"] == "fp8"
    assert ampkit.MixedPrecision("fp8-rowwise", device="cpu").state_dict()["precision"] == "fp8-rowwise"
    assert ampkit.MixedPrecision("fp8-rowwise-gw-hp", device="cpu").state_dict()["precision"] == "fp8-rowwise-gw-hp"


@pytest.mark.parametrize(("saved", "resumed"), [("bf16", "fp8"), ("fp8", "fp8-rowwise"), ("fp8-rowwise", "fp8"),
                                                ("fp8", "bf16"), ("fp8-rowwise", "fp8-rowwise-gw-hp"),
                                                ("fp8-rowwise-gw-hp", "fp8-rowwise")])
def test_fp8_engine_state_of_another_precision_is_refused(saved: str, resumed: str) -> None:
    state = ampkit.MixedPrecision(saved, device="cpu").state_dict()
    engine = ampkit.MixedPrecision(resumed, device="cpu")
    with pytest.raises(ValueError, match=f"saved with precision={saved!r} but the engine runs {resumed!r}"):
        engine.load_state_dict(state)
