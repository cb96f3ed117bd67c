"""EmulatedGemms against the real kernels: per op and dtype within the kernel's own rounding, bitwise where
the fp32 sums cannot differ, fp16 overflow to inf, the ops the model code reaches, and the op tracer on top."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten, tree_map

from ampkit._util.frames import UserFrames
from ampkit.diagnose.core.gemm_emulation import GEMM_OPS, EmulatedGemms, gemms_slow
from ampkit.diagnose.core.modules import ModuleRecorder
from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.trace import OpTracer
from ampkit.precision import cpu_has_fast_bf16, cpu_has_fast_fp16

pytestmark = pytest.mark.numerics

aten = torch.ops.aten
DTYPES = [torch.float16, torch.bfloat16]


def _operands(dtype: torch.dtype, integers: bool) -> dict[str, torch.Tensor]:
    """The operands of every case; ``integers``: small integers, whose products and sums (K <= 256, |x| <= 3)
    are exact in fp32 in any order."""
    def draw(*shape: int) -> torch.Tensor:
        x = torch.randint(-3, 4, shape).float() if integers else torch.randn(*shape)
        return x.to(dtype)

    return {"a": draw(48, 256), "b": draw(256, 40), "bias": draw(40), "v": draw(256), "c": draw(48, 40),
            "A": draw(3, 48, 64), "B": draw(3, 64, 40), "C": draw(3, 48, 40),
            "x": draw(2, 6, 12, 12), "w": draw(8, 6, 3, 3), "cb": draw(8), "go": draw(2, 8, 12, 12)}


# Each case: (its name, the op call on the operands). A positive alpha/beta keeps the magnitude rule simple.
CASES: list[tuple[str, Callable[[dict[str, torch.Tensor]], Any]]] = [
    ("mm", lambda t: t["a"] @ t["b"]),
    ("mm_transposed", lambda t: t["a"] @ t["b"].t().contiguous().t()),
    ("addmm", lambda t: torch.addmm(t["bias"], t["a"], t["b"])),
    ("addmm_scaled", lambda t: torch.addmm(t["c"], t["a"], t["b"], beta=0.5, alpha=2.0)),
    ("bmm", lambda t: t["A"] @ t["B"]),
    ("baddbmm", lambda t: torch.baddbmm(t["C"], t["A"], t["B"], alpha=0.25)),
    ("mv", lambda t: t["a"] @ t["v"]),
    ("addmv", lambda t: torch.addmv(t["a"][:, 0].contiguous(), t["a"], t["v"])),
    ("dot", lambda t: t["v"] @ t["v"]),
    ("convolution", lambda t: F.conv2d(t["x"], t["w"], t["cb"], padding=1)),
    ("convolution_backward", lambda t: aten.convolution_backward(
        t["go"], t["x"], t["w"], [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])),
]


def _emulated(fn: Callable[[], Any]) -> tuple[Any, EmulatedGemms]:
    mode = EmulatedGemms()
    with mode:
        out = fn()
    return out, mode


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _within_rounding(emulated: torch.Tensor, real: torch.Tensor, magnitude: torch.Tensor, steps: float = 1.0) -> bool:
    """|emulated - real| within ``steps`` roundings of the format at the computation's magnitude (the sum of
    |products|): each of the two rounds an fp32 sum once, by at most half a step (plus fp32 rounding noise)."""
    finfo = torch.finfo(real.dtype)
    bound = steps * finfo.eps * magnitude * 1.01 + finfo.tiny
    return bool(((emulated.float() - real.float()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize(("name", "call"), CASES, ids=[c[0] for c in CASES])
def test_gemm_emulation_matches_the_real_kernel_within_its_rounding(name: str, call: Callable, dtype: torch.dtype) -> None:
    t = _operands(dtype, integers=False)
    real = call(t)
    emulated, mode = _emulated(lambda: call(t))
    magnitude = call(tree_map(lambda x: x.float().abs(), t))  # the same op on |operands|: the sum of |products|
    assert sum(mode.emulated.values()) == 1, f"{name} was not emulated: {dict(mode.emulated)}"
    for e, r, m in zip(_tensors(emulated), _tensors(real), _tensors(magnitude), strict=True):
        assert (e.dtype, e.shape, e.stride()) == (r.dtype, r.shape, r.stride()), name
        assert _within_rounding(e, r, m), f"{name}: {(e.float() - r.float()).abs().max().item()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize(("name", "call"), CASES, ids=[c[0] for c in CASES])
def test_gemm_emulation_is_bitwise_equal_where_the_fp32_sums_are_exact(name: str, call: Callable,
                                                                       dtype: torch.dtype) -> None:
    t = _operands(dtype, integers=True)
    real = call(t)
    emulated, _ = _emulated(lambda: call(t))
    for e, r in zip(_tensors(emulated), _tensors(real), strict=True):
        assert torch.equal(e, r), name


def _fp8_operands() -> dict[str, torch.Tensor]:
    return {"a": (torch.randn(48, 64) * 30).to(torch.float8_e4m3fn),
            "b": torch.randn(40, 64).to(torch.float8_e4m3fn).t(),  # column-major, as _scaled_mm takes it
            "g": torch.randn(64, 40).to(torch.float8_e5m2),
            "sa": torch.tensor(0.37), "sb": torch.tensor(1.9),
            "rows": torch.rand(48, 1) + 0.5, "cols": torch.rand(1, 40) + 0.5,
            "bias": torch.randn(40, dtype=torch.bfloat16)}


FP8_CASES: list[tuple[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]] = [
    ("tensorwise", lambda t: torch._scaled_mm(t["a"], t["b"], t["sa"], t["sb"], out_dtype=torch.bfloat16)),
    ("bias", lambda t: torch._scaled_mm(t["a"], t["b"], t["sa"], t["sb"], bias=t["bias"], out_dtype=torch.bfloat16)),
    ("fp32_out", lambda t: torch._scaled_mm(t["a"], t["b"], t["sa"], t["sb"], out_dtype=torch.float32)),
    ("rowwise", lambda t: torch._scaled_mm(t["a"], t["b"], t["rows"], t["cols"], out_dtype=torch.bfloat16)),
    ("e4m3_by_e5m2", lambda t: torch._scaled_mm(t["a"], t["g"], t["sa"], t["sb"], out_dtype=torch.bfloat16)),
]


@pytest.mark.parametrize(("name", "call"), FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_gemm_emulation_scaled_mm_is_bitwise_torchs_cpu_kernel(name: str, call: Callable) -> None:
    t = _fp8_operands()
    real = call(t)
    emulated, mode = _emulated(lambda: call(t))
    assert dict(mode.emulated) == {"aten::_scaled_mm": 1}
    assert emulated.dtype == real.dtype
    assert torch.equal(emulated, real), name


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_gemm_emulation_flash_attention_within_the_kernels_rounding_of_p_and_its_output(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(2, 3, 32, 16).to(dtype) for _ in range(3))
    real = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
    (out, lse), mode = _emulated(lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True))
    assert dict(mode.emulated) == {"aten::_scaled_dot_product_flash_attention_for_cpu": 1}
    assert (out.dtype, out.stride(), lse.dtype) == (real[0].dtype, real[0].stride(), real[1].dtype)
    # P @ |V| (P >= 0): the magnitude of the output's sum; the real kernel rounds P and the output, 1.5 steps.
    magnitude = aten._scaled_dot_product_flash_attention_for_cpu(q.float(), k.float(), v.float().abs(),
                                                                 is_causal=True)[0]
    assert _within_rounding(out, real[0], magnitude, steps=1.5)
    torch.testing.assert_close(lse, real[1], rtol=1e-5, atol=1e-4)  # fp32 in both: the scores' sums in fp32


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_gemm_emulation_flash_attention_backward_within_the_kernels_rounding(dtype: torch.dtype) -> None:
    q, k, v, grad = (torch.randn(2, 3, 32, 16).to(dtype) for _ in range(4))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)

    def backward() -> Any:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)

    real = backward()
    emulated, mode = _emulated(backward)
    assert sum(mode.emulated.values()) == 1
    for e, r in zip(emulated, real, strict=True):
        assert (e.dtype, e.shape) == (r.dtype, r.shape)
        # The backward rounds P and its gradient dS to the format before their GEMMs: a few roundings.
        err = (e.float() - r.float()).norm() / r.float().norm()
        assert err <= 4 * torch.finfo(dtype).eps, err


@pytest.mark.parametrize(("name", "call"), [c for c in CASES if c[0] in ("mm", "addmm", "bmm", "convolution")],
                         ids=["mm", "addmm", "bmm", "convolution"])
def test_gemm_emulation_fp16_overflow_is_inf_where_the_real_kernel_gives_inf(name: str, call: Callable) -> None:
    positive = {k: x.abs() for k, x in _operands(torch.float32, integers=False).items()}
    scale = (65504.0 / _tensors(call(positive))[0].median().item()) ** 0.5  # about half the results overflow
    t = {k: (x * scale).to(torch.float16) for k, x in positive.items()}
    real = _tensors(call(t))[0]
    emulated = _tensors(_emulated(lambda: call(t))[0])[0]
    assert 0.1 < real.isinf().float().mean().item() < 0.9, f"{name}: the case does not straddle fp16's largest value"
    assert torch.equal(emulated.isinf(), real.isinf())
    bf16 = {k: x.to(torch.bfloat16) for k, x in t.items()}
    assert bool(_tensors(_emulated(lambda: call(bf16))[0])[0].isfinite().all())  # bf16 holds what fp16 cannot


def test_gemm_emulation_leaves_fp32_gemms_and_other_ops_to_the_real_kernels() -> None:
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    h = a.half()
    (mm, act), mode = _emulated(lambda: (a @ b, F.gelu(h)))
    assert not mode.emulated
    assert torch.equal(mm, a @ b) and torch.equal(act, F.gelu(h))


def test_gemm_emulation_a_dtype_mismatch_raises_the_real_kernels_error() -> None:
    a, b = torch.randn(4, 4).half(), torch.randn(4, 4)
    with pytest.raises(RuntimeError) as real:
        a @ b
    with pytest.raises(RuntimeError) as emulated, EmulatedGemms():
        a @ b
    assert str(emulated.value) == str(real.value)


class _Attention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        y = self.conv(y.transpose(1, 2)).transpose(1, 2)
        return y @ y.transpose(1, 2) @ y  # two bmm


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_gemm_emulation_covers_every_gemm_an_autocast_model_reaches(dtype: torch.dtype) -> None:
    model, x = _Attention(), torch.randn(2, 8, 16)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype):
            y = model(x)
        y.float().pow(2).mean().backward()

    _, mode = _emulated(step)
    assert set(mode.emulated) == {"aten::addmm", "aten::mm", "aten::bmm", "aten::convolution",
                                  "aten::convolution_backward", "aten::_scaled_dot_product_flash_attention_for_cpu",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert {f"aten::{op.__name__.split('.')[0]}" for op in GEMM_OPS} >= set(mode.emulated)


@pytest.mark.filterwarnings("ignore:precision='fp8' on the CPU")
def test_gemm_emulation_reaches_float8_linears_scaled_mm_through_the_subclass() -> None:
    pytest.importorskip("torchao")
    from ampkit.engine import Engine

    model = Engine("fp8", device=torch.device("cpu")).prepare(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))
    x = torch.randn(16, 32)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().pow(2).mean().backward()
        return y, model[0].weight.grad

    real = step()
    emulated, mode = _emulated(step)
    assert mode.emulated["aten::_scaled_mm"] == 6  # two layers, three GEMMs each
    assert all(torch.equal(e, r) for e, r in zip(emulated, real, strict=True))


def _overflowing_linear() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.fill_(300.0)
    return model, torch.ones(4, 8) * 30.0  # 8 * 30 * 300 = 72000 > 65504


def test_gemm_emulation_under_the_op_tracer_records_the_fp16_op_and_its_inf() -> None:
    model, x = _overflowing_linear()
    with EmulatedGemms(), ModuleRecorder(model) as recorder:
        tracer = OpTracer(model, recorder, user_frames=UserFrames())
        with tracer, torch.autocast("cpu", dtype=torch.float16):
            model(x)
        tracer.finalize()
    gemms = [r for r in tracer.records if r.op in ("aten::addmm", "aten::mm")]
    assert [(r.op, r.module, r.in_dtypes, r.out_dtypes) for r in gemms] == [
        ("aten::addmm", "0", ("fp16", "fp16", "fp16"), ("fp16",)),
        ("aten::addmm", "2", ("fp16", "fp16", "fp16"), ("fp16",))]
    assert tracer.values[gemms[0].out_slots[0]][1] == float("inf")
    assert not [r for r in tracer.records if r.out_dtypes == ("fp32",)]  # none of the emulation's upcasts


def test_gemm_emulation_inside_the_tracer_would_show_it_fp32_gemms_instead() -> None:
    model, x = _overflowing_linear()
    with ModuleRecorder(model) as recorder:
        tracer = OpTracer(model, recorder, user_frames=UserFrames())
        with tracer, EmulatedGemms(), torch.autocast("cpu", dtype=torch.float16):
            model(x)
    assert ("fp32", "fp32", "fp32") in [r.in_dtypes for r in tracer.records if r.op == "aten::addmm"]


def test_gemm_emulation_keeps_the_doctors_overflow_finding() -> None:
    model, x = _overflowing_linear()

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return m(x).float().sum()

    def errors() -> list[tuple[str, str | None, str | None]]:
        result = diagnose_step(model, run, precision="fp16", bisect=False)
        return [(f.code, f.module, f.op) for f in result.findings if f.severity == "error"]

    real = errors()
    emulated, mode = _emulated(errors)
    assert real == emulated == [("FORWARD_OVERFLOW", "0", "aten::addmm")]
    assert mode.emulated["aten::addmm"] >= 2


def test_gemms_slow_follows_the_cpus_fast_units() -> None:
    cpu = torch.device("cpu")
    assert gemms_slow(torch.float16, cpu) is not cpu_has_fast_fp16()
    assert gemms_slow(torch.bfloat16, cpu) is not cpu_has_fast_bf16()
    assert not gemms_slow(torch.float16, torch.device("cuda"))
