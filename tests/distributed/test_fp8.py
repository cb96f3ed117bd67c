"""fp8 under DDP and FSDP2 on 2 gloo ranks, bit for bit against torchao's recipe, in one launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._dist_testlib import Loader, launch, loader

pytestmark = pytest.mark.slow
LAYERS = ["blocks.0.fc", "blocks.0.proj", "blocks.1.fc", "blocks.1.proj", "head"]


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Loader, Path]:
    """Every fp8 scenario of dist_fp8.py, in one torchrun launch (torch + torchao import once per rank)."""
    pytest.importorskip("torchao")
    root = tmp_path_factory.mktemp("dist-fp8")
    result = launch("dist_fp8", ["--out", str(root / "out")], root / "logs")
    if not result.ok:
        pytest.fail("the fp8 distributed launch failed:\n" + result.describe())
    return loader(root / "out"), root / "out"


def _assert_bitexact(load: Loader, name: str) -> dict:
    runs = [load(name, rank) for rank in (0, 1)]
    for rank, res in enumerate(runs):
        assert "error" not in res, f"rank {rank}: {res.get('error')}"
        differ = [n for n in res["recipe"] if not torch.equal(res["engine"][n], res["recipe"][n])]
        assert differ == [], f"rank {rank}: {differ} differ from the torchao recipe"
    assert all(torch.equal(runs[0]["engine"][n], runs[1]["engine"][n]) for n in runs[0]["engine"]), "ranks diverged"
    return runs[0]


def test_distributed_fp8_ranks_import_this_checkout(fp8_run) -> None:
    _, out = fp8_run
    assert Path((out / "ampkit_file.txt").read_text()).resolve().is_relative_to(Path(__file__).resolve().parents[2])


def test_distributed_fp8_ddp_bitexact_with_torchao_recipe(fp8_run) -> None:
    load, _ = fp8_run
    assert _assert_bitexact(load, "ddp_fp8")["layers"] == [f"module.{n}" for n in LAYERS]


@pytest.mark.parametrize("precision", ["fp8", "fp8-rowwise"])
def test_distributed_fp8_fsdp2_shard_converts_first_and_is_bitexact(fp8_run, precision: str) -> None:
    load, _ = fp8_run
    res = _assert_bitexact(load, f"fsdp_{precision}")
    assert res["layers"] == LAYERS
    assert all(kind == "Tensor" for kind, _ in res["weights"].values())


def test_distributed_fp8_fsdp2_all_gather_precomputes_scales_and_is_bitexact(fp8_run) -> None:
    load, _ = fp8_run
    res = _assert_bitexact(load, "fsdp_fp8_all_gather")
    assert res["weights"] == {n: ("WeightWithDynamicFloat8CastTensor", True) for n in LAYERS}


@pytest.mark.parametrize(("case", "expected"), [
    ("rowwise_all_gather", "fp8_all_gather=True with precision='fp8-rowwise': torchao all-gathers fp8 weights only "
                           "with tensorwise scaling"),
    ("all_gather_without_engine", "needs the engine as precision (shard(model, mp, ...))"),
    ("stale_optimizer", "it was built before ampkit.distributed.shard(model, mp, fp8_all_gather=True)"),
    ("convert_after_fully_shard", "fp8 conversion must come before fully_shard"),
])
def test_distributed_fp8_refusals_name_the_fix(fp8_run, case: str, expected: str) -> None:
    load, _ = fp8_run
    for rank in (0, 1):
        message = load("refusals", rank)[case]
        assert message is not None and expected in message, f"rank {rank}: {message}"
