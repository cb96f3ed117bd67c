"""Each section of the GPU check on the CPU at tiny size (``nosync`` with a stand-in guard, ``nccl`` on gloo).

The thresholds are meant for a GPU: these tests check what each section measures and how it
reports it, and every result that does not depend on the machine's speed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpucheck import bitexact, frameworks, nccl, nosync, ratios, replay, verify
from gpucheck.checks import first_difference

CPU = torch.device("cpu")


def test_bitexact_section_engine_equals_recipe_in_every_configuration() -> None:
    checks = list(bitexact.run(CPU, tiny=True))
    assert [c.name for c in checks] == [c.name for c in bitexact.CONFIGS]
    assert {c.name for c in checks} >= {"fp16-plain", "fp16-clip", "fp16-accumulate-4", "fp16-forced-skips",
                                        "fp16-fused-adamw", "bf16-plain", "bf16-clip", "bf16-accumulate-4",
                                        "bf16-fused-adamw"}
    failed = [(c.name, c.detail) for c in checks if c.status != "pass"]
    assert failed == []
    skips = {c.name: c.evidence["skipped"] for c in checks}
    assert skips["fp16-forced-skips"] == 2 and skips["fp16-fused-adamw"] == 1 and skips["bf16-plain"] == 0


def test_bitexact_section_reports_where_a_state_differs() -> None:
    a = {"param": {"w": torch.zeros(3)}, "scale": 2.0}
    b = {"param": {"w": torch.tensor([0.0, 0.5, 0.0])}, "scale": 2.0}
    assert first_difference(a, b, "state") == "state.param.w: max |difference| 0.5"
    assert first_difference(a, {**a, "scale": 4.0}, "state") == "state.scale: 2.0 != 4.0"
    assert first_difference(a, a, "state") is None


def _forbid_sync_calls(monkeypatch: pytest.MonkeyPatch):
    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError("called a synchronizing method")

        with monkeypatch.context() as m:
            for name in ("item", "__bool__", "cpu", "tolist"):
                m.setattr(torch.Tensor, name, refuse)
            yield

    return guard


def test_nosync_section_bare_passes_and_the_refused_reads_are_located(monkeypatch) -> None:
    checks = {c.name: c for c in nosync.run(CPU, tiny=True, guard=_forbid_sync_calls(monkeypatch))}
    assert checks["bare"].status == "pass"
    # On the CPU the doctor reads its verdict at once and the telemetry's gradient counter reads a sum
    # (free there: CPU kernels are synchronous), so a guard that refuses every host read catches both;
    # on CUDA the doctor polls an event instead and the counter reads nothing.
    for setup, where in (("doctor", "ampkit/diagnose/live/doctor.py"), ("telemetry", "ampkit/telemetry/metrics.py")):
        assert checks[setup].status == "fail" and "called a synchronizing method" in checks[setup].detail
        assert where in checks[setup].detail


def test_nosync_section_without_cuda_and_without_a_guard_is_skipped() -> None:
    assert {c.status for c in nosync.run(CPU, tiny=True)} == {"skipped"}


def test_ratios_section_reports_three_judged_ratios_and_the_replay() -> None:
    checks = list(ratios.run(CPU, tiny=True))
    assert [c.key for c in checks] == ["ratios.engine_vs_recipe", "ratios.telemetry_vs_bare", "ratios.doctor_vs_bare",
                                       "ratios.replay_vs_step"]
    for c in checks[:3]:
        assert c.status in ("pass", "fail") and c.threshold == "<= 1.02" and c.measured > 0
        assert c.evidence["steps"] >= 50
    assert checks[3].status == "reported" and checks[3].measured > 0


def test_replay_section_names_the_same_culprit_as_the_cpu_replay() -> None:
    (c,) = replay.run(CPU, tiny=True)
    assert c.status == "pass"
    assert c.evidence["device_culprit"] == c.evidence["cpu_culprit"] == ["FORWARD_OVERFLOW", "ffn", "aten::addmm"]
    assert c.evidence["device_steps"] == 4  # three ordinary steps, then the overflowing one


def test_verify_section_runs_fp32_bf16_and_fp16_and_writes_the_verify_report(tmp_path: Path) -> None:
    checks = list(verify.run(CPU, tiny=True, out=tmp_path))
    assert [c.name for c in checks] == ["fp32", "bf16", "fp16"]
    assert all(c.status == "reported" and c.measured["status"] == "ok" for c in checks)
    assert all(c.measured["tokens_per_s"] > 0 and c.measured["peak_memory_vs_fp32"] > 0 for c in checks)
    bf16 = checks[1].measured
    assert bf16["mfu"] is None and bf16["peak_bf16_tflops"] is None  # no published peak for a CPU
    assert sorted(p.name for p in (tmp_path / "verify").iterdir()) == ["report.html", "report.json", "report.md"]


def test_verify_section_flops_per_token_counts_parameters_and_attention() -> None:
    from ampkit.tasks.gpt import GPT
    from gpucheck.verify_task import tiny

    task = tiny()
    n = sum(p.numel() for p in GPT(task.config).parameters())
    cfg = task.config
    assert verify.flops_per_token(task) == 6 * n + 12 * cfg.n_layer * cfg.d_model * cfg.block_size


def test_nccl_section_on_gloo_passes_setup_and_the_dcp_round_trip() -> None:
    checks = list(nccl.run(CPU, tiny=True, backend="gloo"))
    assert [(c.key, c.status) for c in checks] == [("nccl.setup", "pass"), ("nccl.dcp_round_trip", "pass")]
    assert checks[0].evidence["backend"] == "gloo"


def test_nccl_section_without_cuda_is_skipped() -> None:
    assert {c.status for c in nccl.run(CPU, tiny=True)} == {"skipped"}


@pytest.mark.filterwarnings("ignore:SCHEDULER_STEPPED_ON_SKIP")
def test_frameworks_section_trainer_resume_and_fused_skip_pass() -> None:
    pytest.importorskip("transformers")
    checks = list(frameworks.run(CPU, tiny=True))
    assert [(c.key, c.status) for c in checks] == [("frameworks.scale_round_trip", "pass"),
                                                   ("frameworks.skip_backoff", "pass")], [c.detail for c in checks]
    assert "SCHEDULER_STEPPED_ON_SKIP" in checks[1].evidence["warnings"]
