"""fp8 operand statistics: amax and flush fraction of each Float8Linear operand, sampled, without a sync."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.telemetry import Telemetry, fp8stats
from ampkit.telemetry.fp8stats import CastSpec, cast_specs, fp8_scale, operand_stats

from .telemetry_helpers import FORBIDDEN, ForbiddenSync, count_as_on_an_accelerator

pytest.importorskip("torchao")
from ampkit.fp8 import _import_float8

_import_float8()  # torchao's import-time log lines held back, as the engine does
from torchao.float8.config import Float8LinearConfig, ScalingGranularity  # noqa: E402
from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PRECISIONS = ("fp8", "fp8-rowwise", "fp8-rowwise-gw-hp")
_LAYERS = ("0", "2")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _engine(precision: str, records: list[dict], **kw: object) -> tuple[ampkit.MixedPrecision, nn.Module,
                                                                         torch.optim.Optimizer]:
    tel = Telemetry(sinks=[records.append], **kw)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no fp8 GEMM on the CPU": known, CPU's _scaled_mm runs it
        mp = ampkit.MixedPrecision(precision, device="cpu", telemetry=tel)
        model = mp.prepare(_mlp())
    return mp, model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _step(mp: ampkit.MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.backward(loss)
    mp.step(opt)


def _outlier_input() -> tuple[torch.Tensor, torch.Tensor]:
    """16x32: 1e-3 and 1.0 in a checkerboard, a zero column, and one outlier of 1000 at [0, 0].
    Returns the tensor and the mask of its tiny values."""
    r, c = torch.meshgrid(torch.arange(16), torch.arange(32), indexing="ij")
    x = torch.where((r + c) % 2 == 0, 1e-3, 1.0)
    x[:, -1] = 0.0
    x[0, 0] = 1000.0
    return x, x == 1e-3


# -- the cast, against torchao's own functions ----------------------------------------------------------
@pytest.mark.parametrize(("dtype", "granularity", "dim", "pow2"), [
    (E4M3, "tensorwise", None, False), (E5M2, "tensorwise", None, False),
    (E4M3, "axiswise", -1, True), (E4M3, "axiswise", 0, True)])
def test_fp8stats_scale_and_flush_match_torchao(dtype: torch.dtype, granularity: str, dim: int | None,
                                                pow2: bool) -> None:
    x = torch.randn(48, 32) * 10.0 ** (torch.rand(48, 32) * 12 - 9)  # elements across 12 decades: many flush
    x[3, 5] = 0.0
    gran = ScalingGranularity(granularity)
    scale = tensor_to_scale(x, dtype, scaling_granularity=gran, axiswise_dim=dim, round_scales_to_power_of_2=pow2)
    amax = x.abs().max() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    ours = fp8_scale(amax, dtype, pow2=pow2)
    assert ours.dtype == scale.dtype and torch.equal(ours, scale)
    bits = hp_tensor_and_scale_to_float8(x, scale, dtype, axiswise_dim=dim)._data
    expected = int(((bits.float() == 0) & (x != 0)).sum())
    assert expected > 0, "the decades below the amax must flush"
    stats = operand_stats(x, (CastSpec(dtype, dim, pow2),))
    assert stats.tolist() == [float(x.abs().max()), expected, x.numel() - 1]


def test_fp8stats_cast_specs_follow_torchao_recipes() -> None:
    tw = Float8LinearConfig.from_recipe_name("tensorwise")
    assert [cast_specs(tw, op) for op in fp8stats.OPERANDS] == [
        (CastSpec(E4M3, None, False),), (CastSpec(E4M3, None, False),), (CastSpec(E5M2, None, False),)]
    rw = Float8LinearConfig.from_recipe_name("rowwise")
    assert [cast_specs(rw, op) for op in fp8stats.OPERANDS] == [
        (CastSpec(E4M3, -1, True), CastSpec(E4M3, 0, True)), (CastSpec(E4M3, 0, True), CastSpec(E4M3, -1, True)),
        (CastSpec(E4M3, -1, True), CastSpec(E4M3, 0, True))]
    hp = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")  # the weight-gradient GEMM stays in bf16
    assert cast_specs(hp, "input") == (CastSpec(E4M3, -1, True),)


# -- records of a training run ---------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
def test_telemetry_fp8_amax_is_the_max_abs_of_each_operand(precision: str) -> None:
    records: list[dict] = []
    mp, model, opt = _engine(precision, records, flush_every=3, fp8_stats_every=2)
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def capture(name: str):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            out.retain_grad()  # autograd keeps .grad: independent of the telemetry's tensor hook
            seen[name] = {"input": args[0].detach().clone(), "weight": module.weight.detach().clone(), "out": out}
        return hook

    for name in _LAYERS:
        model.get_submodule(name).register_forward_hook(capture(name))
    expected = []
    for _ in range(3):
        _step(mp, model, opt, torch.randn(16, 32))
        expected.append({n: {"input": float(s["input"].abs().max()), "weight": float(s["weight"].abs().max()),
                             "grad_output": float(s["out"].grad.abs().max())} for n, s in seen.items()})
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["fp8_amax"] == expected[0] and records[2]["fp8_amax"] == expected[2]
    assert "fp8_amax" not in records[1] and "fp8_flush_fraction" not in records[1]
    mp.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_telemetry_fp8_flush_fraction_of_an_outlier_input_is_exact(precision: str) -> None:
    records: list[dict] = []
    mp, model, opt = _engine(precision, records, flush_every=1, fp8_stats_every=1)
    x, tiny = _outlier_input()
    nonzero = int((x != 0).sum())
    if precision == "fp8":
        # One scale 448 / 1000: 1e-3 becomes 4.5e-4, below half of e4m3's smallest subnormal (2**-10);
        # 1.0 becomes 0.448, representable.  So exactly the tiny values flush.
        flushed = int(tiny.sum())
    else:
        # Rowwise: the input is scaled per row (forward GEMM) and per column (weight-gradient GEMM), with
        # scales rounded down to powers of 2; only row 0 and column 0 hold the outlier.  Elsewhere the
        # amax is 1.0 (scale 256), and 1e-3 * 256 is representable.  gw-hp casts it per row only: its
        # weight-gradient GEMM takes the input in bf16.
        r, c = torch.meshgrid(torch.arange(16), torch.arange(32), indexing="ij")
        outlier = (r == 0) if precision == "fp8-rowwise-gw-hp" else (r == 0) | (c == 0)
        flushed = int((tiny & outlier).sum())
    _step(mp, model, opt, x)
    fraction = records[0]["fp8_flush_fraction"]["0"]["input"]
    assert fraction == flushed / nonzero and fraction > (0.45 if precision == "fp8" else 0.01)
    assert records[0]["fp8_amax"]["0"]["input"] == 1000.0
    mp.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_telemetry_fp8_flush_fraction_of_a_benign_input_is_zero(precision: str) -> None:
    records: list[dict] = []
    mp, model, opt = _engine(precision, records, flush_every=1, fp8_stats_every=1)
    _step(mp, model, opt, torch.randn(16, 32))
    fractions = records[0]["fp8_flush_fraction"]
    assert fractions["0"]["input"] == 0.0 and fractions["0"]["weight"] == 0.0
    assert all(v is not None and v < 1e-3 for ops in fractions.values() for v in ops.values())
    mp.close()


def test_telemetry_fp8_accumulation_takes_the_max_and_sums_the_counts() -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=1, fp8_stats_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp = ampkit.MixedPrecision("fp8", device="cpu", telemetry=tel, grad_accumulation=2)
        model = mp.prepare(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, tiny = _outlier_input()
    benign = torch.ones(16, 32)
    for micro in (x, benign):
        with mp.autocast():
            loss = model(micro).float().pow(2).mean()
        mp.backward(loss)
        mp.step(opt)
    assert len(records) == 1
    assert records[0]["fp8_amax"]["0"]["input"] == 1000.0
    assert records[0]["fp8_flush_fraction"]["0"]["input"] == int(tiny.sum()) / (int((x != 0).sum()) + benign.numel())
    mp.close()


# -- cost: nothing on steps that are not sampled, no sync ------------------------------------------------
def test_telemetry_fp8_unsampled_steps_measure_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = fp8stats.operand_stats
    monkeypatch.setattr(fp8stats, "operand_stats", lambda *a: calls.append(1) or original(*a))
    records: list[dict] = []
    mp, model, opt = _engine("fp8", records, flush_every=4, fp8_stats_every=3)
    per_step = []
    for _ in range(4):
        before = len(calls)
        _step(mp, model, opt, torch.randn(16, 32))
        per_step.append(len(calls) - before)
    assert per_step == [6, 0, 0, 6]  # 2 layers x (input, weight, grad_output) on steps 1 and 4
    assert [("fp8_amax" in r) for r in records] == [True, False, False, True]
    mp.close()


def test_telemetry_fp8_default_samples_every_100_steps_and_0_turns_it_off() -> None:
    on, off = [], []
    mp, model, _ = _engine("fp8", on)
    assert mp.telemetry._fp8.every == fp8stats.DEFAULT_EVERY == 100
    mp0, model0, _ = _engine("fp8", off, fp8_stats_every=0)
    assert mp0.telemetry._fp8.names == [] and not model0[0]._forward_pre_hooks
    mp.close()
    mp0.close()
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks, "close removes the hooks"


def _forbid(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FORBIDDEN:
        def raiser(self: torch.Tensor, *args: object, _name: str = name, **kwargs: object) -> None:
            raise ForbiddenSync(f"Tensor.{_name} was called between flushes")

        monkeypatch.setattr(torch.Tensor, name, raiser)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_telemetry_fp8_no_host_sync_between_flushes(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 5
    records: list[dict] = []
    count_as_on_an_accelerator(monkeypatch)
    mp, model, opt = _engine(precision, records, flush_every=n, fp8_stats_every=2)
    batches = [torch.randn(16, 32) for _ in range(n)]
    with monkeypatch.context() as patch:
        _forbid(patch)
        for x in batches[:-1]:  # steps 1-4: sampled (1, 3) and not (2, 4)
            _step(mp, model, opt, x)
        with pytest.raises(ForbiddenSync):  # the guard is live
            bool(torch.ones(()))
    assert records == [] and mp.telemetry.pending == n - 1
    reads = []
    original = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> object:
        reads.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    _step(mp, model, opt, batches[-1])  # step 5 (sampled) flushes
    assert len(reads) == 1, f"a flush must read the device exactly once, read {reads}"
    assert [("fp8_amax" in r) for r in records] == [True, False, True, False, True]
    mp.close()


# -- non-fp8 engines ---------------------------------------------------------------------------------------
def test_telemetry_fp8_fields_absent_and_nothing_hooked_without_fp8_layers() -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=1, fp8_stats_every=1)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    model = mp.prepare(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _step(mp, model, opt, torch.randn(16, 32))
    assert tel._fp8.names == [] and not any(m._forward_hooks for m in model.modules())
    assert not any(k.startswith("fp8") for k in records[0])
    mp.close()


def test_telemetry_non_fp8_engine_with_fp8_stats_never_imports_torchao() -> None:
    code = (
        "import sys, torch\nimport ampkit\n"
        "tel = ampkit.Telemetry(fp8_stats_every=1, flush_every=1)\n"
        "mp = ampkit.MixedPrecision('bf16', device='cpu', telemetry=tel)\n"
        "m = mp.prepare(torch.nn.Sequential(torch.nn.Linear(32, 32)))\n"
        "opt = torch.optim.AdamW(m.parameters(), fused=True)\n"
        "with mp.autocast():\n    loss = m(torch.randn(4, 32)).float().sum()\n"
        "mp.backward(loss); mp.step(opt); mp.close()\n"
        "assert 'torchao' not in sys.modules, 'fp8 telemetry imported torchao for a bf16 engine'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_telemetry_fp8_observed_loop_records_torchao_layers() -> None:
    # A loop ampkit does not drive, on a model converted by torchao itself.
    from torchao.float8 import convert_to_float8_training

    model = convert_to_float8_training(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    records: list[dict] = []
    obs = ampkit.telemetry.observe(opt, model=model, telemetry=Telemetry(sinks=[records.append], fp8_stats_every=2))
    x = torch.randn(16, 32)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    obs.close()
    assert [("fp8_amax" in r) for r in records] == [True, False, True]
    assert records[0]["fp8_amax"]["0"]["input"] == float(x.abs().max())
