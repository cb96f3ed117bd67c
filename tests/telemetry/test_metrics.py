"""The on-device reductions: exact counts across chunk boundaries and dtypes, module naming, input watch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ampkit
from ampkit.telemetry import Telemetry
from ampkit.telemetry.metrics import GradCounter, MetricBuffer, ModuleAbsmax, _plan_chunks

from .telemetry_helpers import batch, train_step


def _grads_with_specials(dtype: torch.dtype) -> list[torch.Tensor]:
    grads = [torch.randn(n, dtype=dtype) for n in (1, 7, 64, 1000, 3)]
    for g in grads:
        g[::3] = 0.0
    transposed = torch.randn(5, 6, dtype=dtype).t()  # not contiguous
    transposed[:, 0] = 0.0
    transposed[1, 2] = math.nan
    grads.append(transposed)
    grads[3][::7] = math.nan
    grads[3][5] = math.inf
    grads[2][-1] = -math.inf
    grads[1][0] = -0.0
    grads[0][0] = 1e-40 if dtype != torch.float16 else 1e-7  # subnormal: not zero
    return grads


@pytest.mark.parametrize("workspace", [1, 5, 30, 64, 1 << 18])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_telemetry_metrics_counts_are_exact_across_chunks(workspace: int, dtype: torch.dtype) -> None:
    grads = _grads_with_specials(dtype)
    zeros, nonfinite = GradCounter(torch.device("cpu"), workspace_elements=workspace).count(grads)
    assert float(zeros) == sum(int((g == 0).sum()) for g in grads)
    assert float(nonfinite) == sum(int((~torch.isfinite(g)).sum()) for g in grads)


def test_telemetry_metrics_counts_mixed_dtypes_and_nothing() -> None:
    counter = GradCounter(torch.device("cpu"), workspace_elements=16)
    grads = _grads_with_specials(torch.float32) + _grads_with_specials(torch.bfloat16)
    zeros, nonfinite = counter.count(grads)
    assert float(zeros) == sum(int((g == 0).sum()) for g in grads)
    assert float(nonfinite) == sum(int((~torch.isfinite(g)).sum()) for g in grads)
    assert [float(c) for c in counter.count([])] == [0.0, 0.0]
    with pytest.raises(ValueError, match="workspace_elements"):
        GradCounter(torch.device("cpu"), workspace_elements=1 << 25)


def test_telemetry_metrics_counts_sparse_gradients_as_their_dense_values() -> None:
    # Uncoalesced: row 2 appears twice, and its two halves cancel to an explicit zero once summed.
    indices = torch.tensor([[1, 2, 2, 4]])
    values = torch.tensor([[1.0, 0.5], [3.0, -0.5], [-3.0, math.inf], [0.0, 2.0]])
    sparse = torch.sparse_coo_tensor(indices, values, (6, 2))
    dense = torch.randn(5)
    dense[0] = 0.0
    zeros, nonfinite = GradCounter(torch.device("cpu"), workspace_elements=4).count([sparse, dense])
    as_dense = sparse.to_dense()
    assert float(zeros) == int((as_dense == 0).sum()) + 1 and float(nonfinite) == 1


def test_telemetry_metrics_counts_complex_elements_whole_without_warning() -> None:
    # An element is zero when both parts are, non-finite when either is.
    z = torch.tensor([0j, 1 + 0j, 1j, complex(float("nan"), 0.0), complex(0.0, float("inf"))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zeros, nonfinite = GradCounter(torch.device("cpu")).count([z, torch.tensor([0.0, float("inf")])])
    assert (int(zeros), int(nonfinite)) == (2, 3)


def test_telemetry_records_a_sparse_embedding_step() -> None:
    records: list[dict] = []
    emb = torch.nn.Embedding(50, 8, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision("fp16", device="cpu",
                               telemetry=Telemetry([ampkit.CallbackSink(records.append)], flush_every=2,
                                                   zero_grads_every=1))
    mp.prepare(emb)
    for _ in range(2):
        with mp.autocast():
            loss = emb(torch.tensor([1, 2, 2, 3])).float().sum()
        mp.backward(loss)
        mp.step(opt)
    mp.close()
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["zero_grad_fraction"] == pytest.approx((400 - 24) / 400)


def test_telemetry_metrics_chunk_plan_covers_every_element_once() -> None:
    numels = [5, 1, 17, 0, 4, *([3] * 10)]
    for cap in (1, 3, 4, 16, 100):
        plan = _plan_chunks(numels, cap)
        assert all(sum(b - a for _, a, b in chunk) <= cap for chunk in plan)
        covered = sorted((i, k) for chunk in plan for i, a, b in chunk for k in range(a, b))
        assert covered == [(i, k) for i, n in enumerate(numels) for k in range(n)]


def test_telemetry_metrics_module_names_root_and_unnamed() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(2)))
    stray = torch.nn.Parameter(torch.ones(1))
    params = [*model.parameters(), stray]
    grads = [torch.full_like(p, float(i + 1)) for i, p in enumerate(params)]
    grads[1][0] = -7.0
    absmax = ModuleAbsmax(torch.device("cpu"))
    values, present = absmax.compute(params, grads, [model])
    named = {absmax.names[j]: float(values[j]) for j in present}
    assert named == {"(root)": 1.0, "0": 7.0, "(unnamed)": 4.0}  # parameters() lists own params first


def test_telemetry_metrics_buffer_module_rows_grow_on_device() -> None:
    buf = MetricBuffer(torch.device("cpu"), rows=4)
    buf.module_row(0, 2).copy_(torch.tensor([1.0, 2.0], dtype=buf.dtype))
    buf.module_row(5, 3)[:3].copy_(torch.tensor([3.0, 4.0, 5.0], dtype=buf.dtype))
    buf.row("fp8", 1, 2).copy_(torch.tensor([6.0, 7.0], dtype=buf.dtype))
    steps, tables = buf.read(0, {"modules": 6, "fp8": 2})
    modules = tables["modules"]
    assert steps == [] and modules[0][:2] == [1.0, 2.0] and modules[5] == [3.0, 4.0, 5.0]
    assert tables["fp8"][1] == [6.0, 7.0]


def test_telemetry_metrics_input_watch_ignores_evaluation_forwards(tiny: torch.nn.Module) -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=2, alarms=())
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    x, idx, y = batch()
    bad = x.clone()
    bad[0, 0] = math.nan
    with torch.no_grad():
        tiny(bad, idx)  # an evaluation pass on bad data belongs to no training step
    train_step(mp, tiny, opt, x, idx, y)
    train_step(mp, tiny, opt, bad, idx, y)
    assert [r["input_nonfinite"] for r in records] == [False, True]
    assert records[1]["loss_nonfinite"] and records[1]["skipped"]
