"""Section ``fp8``: the fp8 engine (torchao float8) on a GPU with fp8 GEMMs, a call of its own (``--only fp8``).

In order, cheapest first, so that a section killed at its cap keeps the correctness checks:

* ``recipe``: the engine's fp8 step against torchao's recipe written out by hand
  (``gpucheck.fp8recipe``: ``convert_to_float8_training``, bf16 autocast, backward, clip, AdamW),
  on copies of the check's MLP, tensorwise, rowwise, rowwise_with_gw_hp, and tensorwise with
  accumulation 2, under ``torch.use_deterministic_algorithms(True)`` on CUDA.  Pass: parameters and
  optimizer state bitwise equal.  rowwise_with_gw_hp runs without autocast on a CPU, where torchao's
  recipe raises under it (docs/fp8.md); on CUDA it checks that ampkit's input cast changes nothing.
* ``doctor``: ``ampkit.diagnose.diagnose_step`` on a Linear -> GELU -> Linear whose input carries one
  outlier column (1e6 next to values of order 1, the column's weights zeroed).  With tensorwise
  scaling the outlier sets the first layer's input scale and the rest of its input flushes to
  zero in e4m3.  Pass: FP8_FLUSH names layer ``0``, operand ``input``, and nothing else, and the
  verified ``fp8_filter`` is ``['0']``.
* ``mlp_speedup`` and ``gpt_speedup``: fp8 against bf16 tokens/s, both compiled
  (``gpucheck.fp8speed``).

Skipped, with the reason, on CUDA below compute capability 8.9 (no fp8 GEMM: torchao would
emulate), on a CPU unless ``--tiny`` (the tests: torch's CPU ``_scaled_mm`` at tiny sizes, speed
reported, not judged), and where torchao is missing or does not import.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import ampkit
from ampkit.fp8 import FP8_EXTRA, has_fp8_gemm, torchao_installed
from gpucheck.checks import Check, check, skipped
from gpucheck.fp8recipe import fp8_sized, train_engine, train_recipe, training_difference
from gpucheck.models import mlp, mlp_batches

__all__ = ["KEYS", "RECIPE_CONFIGS", "doctor_check", "recipe_check", "run", "unavailable"]

KEYS = ("fp8.recipe", "fp8.doctor", "fp8.mlp_speedup", "fp8.gpt_speedup")
RECIPE_CONFIGS = (
    # (name, precision, accumulation, clip)
    ("fp8-tensorwise-clip", "fp8", 1, 1.0),
    ("fp8-rowwise-clip", "fp8-rowwise", 1, 1.0),
    ("fp8-rowwise-gw-hp-clip", "fp8-rowwise-gw-hp", 1, 1.0),
    ("fp8-accumulate-2", "fp8", 2, 0.5),
)
DOCTOR_SIZES = {"full": (256, 1024, 256, 512), "tiny": (32, 64, 16, 64)}
"""(inputs, width, outputs, batch) of the doctor's model; every dimension a multiple of 16 (fp8-sized)."""
OUTLIER = 1e6


def unavailable(device: torch.device, tiny: bool) -> str | None:
    """Why the section cannot run on ``device``, or None.  Imports torchao (about 2 s) when all else is there."""
    if device.type == "cpu" and not tiny:
        return ("fp8 on a CPU runs torch's CPU _scaled_mm, slower than bf16: only --device cpu --tiny runs it, "
                "to test the section's code")
    if device.type not in ("cpu", "cuda"):
        return f"needs CUDA with compute capability 8.9 or above (or --device cpu --tiny); this is {device.type}"
    if device.type == "cuda" and not has_fp8_gemm(device):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; fp8 GEMMs need 8.9 "
                "or above (Ada, Hopper, Blackwell), below it torchao only emulates fp8")
    if not torchao_installed():
        return (f"torchao is not installed ({FP8_EXTRA}; on a machine without a package index, carry the wheel: "
                "docs/gpu-check.md, 'The fp8 section')")
    try:
        importlib.import_module("torchao.float8")
    except Exception as exc:  # a torchao built for another torch fails in many ways, not only ImportError
        return f"torchao does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels on CUDA for the bitwise comparison only: the timed compiles after it must not
    run under them (inductor would pick other, slower kernels)."""
    if device.type != "cuda":
        yield
        return
    torch.use_deterministic_algorithms(True)  # needs CUBLAS_WORKSPACE_CONFIG, set by the runner
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def recipe_check(name: str, precision: str, accumulation: int, clip: float, device: torch.device, tiny: bool,
                 steps: int) -> Check:
    base = mlp(tiny).to(device)
    batches = mlp_batches(tiny, steps * accumulation, device)
    autocast = device.type == "cuda" or precision != "fp8-rowwise-gw-hp"  # where torchao's recipe runs
    with _deterministic(device):
        recipe = train_recipe(copy.deepcopy(base), precision, batches, accumulation=accumulation, clip=clip, lr=1e-3,
                              module_filter_fn=fp8_sized, autocast=autocast)
        model, opt, mp = train_engine(copy.deepcopy(base), precision, batches, lr=1e-3, autocast=autocast,
                                      grad_accumulation=accumulation, clip_grad_norm=clip)
    problem = training_difference(recipe, (model, opt))
    if problem is None and not mp.fp8.layers:
        problem = "no layer was converted to fp8"
    if problem is None and all(torch.equal(p, q) for p, q in zip(base.parameters(), model.parameters())):
        problem = "training did not change the weights"
    return check("fp8.recipe", name, problem is None,
                 problem or f"bitwise equal after {steps} optimizer steps, {len(mp.fp8.layers)} fp8 layers",
                 steps=steps, accumulation=accumulation, clip=clip, fp8_layers=mp.fp8.layers, autocast=autocast)


def _outlier_step(device: torch.device, tiny: bool) -> tuple[nn.Module, Any]:
    """The doctor's fp8 model and its step: one input column of ``OUTLIER``, the column's weights zero."""
    d_in, width, d_out, batch = DOCTOR_SIZES["tiny" if tiny else "full"]
    torch.manual_seed(0)
    mp = ampkit.MixedPrecision("fp8", device=device)
    first = nn.Linear(d_in, width)
    with torch.no_grad():
        first.weight[:, 0] = 0.0  # the outlier column is never read: what flushes is the rest of the input
    model = mp.prepare(nn.Sequential(first, nn.GELU(), nn.Linear(width, d_out)).to(device))
    x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(2)).to(device)
    x[:, 0] = OUTLIER

    def step(m: nn.Module) -> torch.Tensor:
        with mp.autocast():
            return m(x).float().pow(2).mean()

    return model, step


def doctor_check(device: torch.device, tiny: bool) -> Check:
    from ampkit.diagnose import diagnose_step

    model, step = _outlier_step(device, tiny)
    result = diagnose_step(model, step, precision="fp8")
    flush = [f for f in result.findings if f.code == "FP8_FLUSH"]
    got = [(f.module, f.evidence.get("operand")) for f in flush]
    ok = got == [("0", "input")] and result.fp8_filter == ["0"]
    detail = (f"FP8_FLUSH at {got or 'no layer'}, verified fp8_filter {result.fp8_filter}"
              + ("" if ok else "; expected FP8_FLUSH at [('0', 'input')] and fp8_filter ['0']"))
    return check("fp8.doctor", "injected activation outlier", ok, detail,
                 findings=[f.code for f in result.findings], fp8_filter=result.fp8_filter,
                 flush_fraction=flush[0].evidence.get("flush_fraction") if flush else None,
                 fix=flush[0].fix if flush else None)


def run(device: torch.device, *, tiny: bool) -> Iterator[Check]:
    why = unavailable(device, tiny)
    if why is not None:
        for key in KEYS:
            yield skipped(key, key.split(".")[1], why)
        return
    from gpucheck.fp8speed import gpt_speedup, mlp_speedup

    with warnings.catch_warnings():
        if device.type == "cpu":
            warnings.filterwarnings("ignore", message=r".*no fp8 GEMM")  # known here: the CPU's _scaled_mm
        steps = 6 if tiny else 20
        for name, precision, accumulation, clip in RECIPE_CONFIGS:
            yield recipe_check(name, precision, accumulation, clip, device, tiny, steps)
        yield doctor_check(device, tiny)
        yield mlp_speedup(device, tiny)
        yield gpt_speedup(device, tiny)
