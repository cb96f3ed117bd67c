"""Mixed precision asked for versus what ran: MIXED_PRECISION_OFF and the JSON ``mixed_precision`` record."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable
from contextlib import nullcontext
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

from ampkit.diagnose.report.json import doctor_document
from ampkit.diagnose.script.context import Context
from ampkit.diagnose.script.mixed import (
    fp32_note,
    mixed_precision_record,
    report_mixed_precision_off,
    requested_flags,
    trained_in,
)
from ampkit.diagnose.script.runner import run_script
from diagnose.script.observe import observe

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="torch disables a 'cuda' GradScaler only without CUDA")


def _train(make_scaler: Callable[[], torch.amp.GradScaler], autocast: torch.dtype | str | None,
           steps: int = 2) -> None:
    """A CPU loop; ``autocast``: a dtype, ``"off"`` (built with enabled=False) or None (no autocast)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    for _ in range(steps):
        if isinstance(autocast, torch.dtype):
            ctx: Any = torch.autocast("cpu", dtype=autocast)
        else:
            ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=False) if autocast == "off" else nullcontext()
        with ctx:
            loss = model(torch.randn(3, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _off(ctx: Context) -> list:
    return [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]


def test_requested_flags_names_dtype_settings_and_switches_but_not_lookalikes() -> None:
    cfg = argparse.Namespace(amp=True, bf16=False, precision="bf16-mixed", sample_amplitude=True)
    flags = requested_flags({"dtype": "float16", "ptdtype": torch.float16, "out_dtype": torch.float32,
                             "device": "cuda", "mode": "half", "use_amp": True, "args": cfg})
    assert flags == {"dtype": "float16", "ptdtype": "fp16", "use_amp": "True", "args.amp": "True",
                     "args.precision": "bf16-mixed"}


@no_cuda
def test_mixed_precision_off_reports_a_cuda_scaler_torch_disabled_with_its_line_and_reason() -> None:
    def make() -> torch.amp.GradScaler:
        return torch.cuda.amp.GradScaler(enabled=True)

    ctx = observe(lambda: _train(make, None))
    scaler_off = [f for f in _off(ctx) if f.evidence["what"] == "scaler"]
    assert len(scaler_off) == 1
    f = scaler_off[0]
    assert f.severity == "warning" and f.location == f"{Path(__file__).relative_to(Path.cwd())}:{make.__code__.co_firstlineno + 1}"
    assert f.evidence["off_reason"] == "no_cuda" and f.evidence["built_as"] == "torch.cuda.amp.GradScaler"
    assert "no CUDA device" in f.message and "trained in fp32" in f.message
    assert "torch.amp.GradScaler(device_type)" in f.fix and "add a GradScaler" not in f.fix


@no_cuda
def test_mixed_precision_off_reports_no_autocast_region_when_a_scaler_asks_for_mixed_precision() -> None:
    ctx = observe(lambda: _train(lambda: torch.amp.GradScaler("cuda"), None))
    region = [f for f in _off(ctx) if f.evidence["what"] == "autocast"]
    assert len(region) == 1 and region[0].severity == "warning"
    assert region[0].evidence["forwards"] == 2 and "no autocast was built for 'cpu'" in region[0].message


def test_mixed_precision_off_reports_no_autocast_region_when_only_a_setting_asks() -> None:
    def fp32_loop() -> None:
        model = nn.Linear(4, 2)
        model(torch.randn(3, 4)).sum().backward()

    ctx = observe(fp32_loop)
    assert _off(ctx) == []  # nothing asked for mixed precision yet
    report_mixed_precision_off(ctx, {"dtype": "bfloat16"})
    (f,) = _off(ctx)
    assert "dtype = 'bfloat16'" in f.message and f.evidence["flags"] == {"dtype": "bfloat16"}


def test_mixed_precision_off_does_not_count_a_disabled_scaler_as_a_request() -> None:
    ctx = observe(lambda: _train(lambda: torch.amp.GradScaler("cpu", enabled=False), None))
    report_mixed_precision_off(ctx, {"dtype": "bfloat16"})  # nanoGPT: GradScaler(enabled=dtype == 'float16')
    (f,) = _off(ctx)
    assert "GradScaler" not in f.message and "dtype = 'bfloat16'" in f.message


def test_mixed_precision_off_stays_silent_when_the_scripts_own_switches_are_off() -> None:
    ctx = observe(lambda: _train(lambda: torch.amp.GradScaler("cpu", enabled=False), "off"))
    assert ctx.state.ledger.findings() == []
    record = mixed_precision_record(ctx, {})
    assert record["requested"]["amp"] is False and record["actual"]["scaler"] == "inactive"
    assert record["summary"] == fp32_note(record) and "switches turn mixed precision off" in record["summary"]


@no_cuda
def test_mixed_precision_off_is_info_for_a_disabled_scaler_in_a_bf16_run() -> None:
    ctx = observe(lambda: _train(lambda: torch.amp.GradScaler("cuda"), torch.bfloat16))
    (f,) = _off(ctx)
    assert f.severity == "info" and f.evidence["trained_in"] == "mixed"


@no_cuda
def test_mixed_precision_off_leaves_a_cuda_autocast_to_autocast_inactive_and_names_the_scaler_there() -> None:
    def cuda_loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(3, 4)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    ctx = observe(cuda_loop)
    assert [f.code for f in ctx.state.ledger.findings()] == ["AUTOCAST_INACTIVE"]
    assert "GradScaler created at" in ctx.state.ledger.findings()[0].message


def test_mixed_precision_record_counts_autocast_regions_dtypes_and_an_active_scaler() -> None:
    ctx = observe(lambda: _train(lambda: torch.amp.GradScaler("cpu"), torch.float16, steps=3))
    record = mixed_precision_record(ctx, {}, "fp16")
    assert record["actual"] == {"forwards": 3, "autocast_regions": 3, "autocast_dtypes": ["fp16"],
                                "scaler": "active", "trained_in": "mixed"}
    assert record["requested"]["amp"] is True and record["requested"]["precision"] == "fp16"
    assert [a["entered"] for a in record["requested"]["autocast"]] == [3]
    assert record["summary"] is None and trained_in(ctx) == "mixed"


def test_fp32_note_says_a_run_without_any_request_trained_in_fp32() -> None:
    ctx = observe(lambda: nn.Linear(4, 2)(torch.randn(3, 4)).sum().backward())
    record = mixed_precision_record(ctx, {})
    assert record["actual"]["trained_in"] == "fp32" and record["requested"]["amp"] is False
    assert record["summary"] is not None and "never enables mixed precision" in record["summary"]


@no_cuda
def test_mixed_precision_json_record_of_a_script_run_validates_against_the_schema(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from contextlib import nullcontext
        import torch
        from torch import nn
        dtype = "float16"
        ctx = nullcontext()
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.cuda.amp.GradScaler(enabled=dtype == "float16")
        for _ in range(2):
            with ctx:
                loss = model(torch.randn(3, 4)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    """))
    report = run_script(script, checkup=False, measure_speed=False)
    doc = json.loads(json.dumps(doctor_document(report)))
    jsonschema.validate(doc, json.loads(resources.files("ampkit").joinpath("schemas/doctor.schema.json").read_text()))
    record = doc["mixed_precision"]
    assert record["requested"]["flags"] == {"dtype": "float16"}
    assert record["requested"]["scalers"][0]["off_reason"] == "no_cuda"
    assert record["actual"]["trained_in"] == "fp32" and record["actual"]["scaler"] == "inactive"
    assert {f["code"] for f in doc["findings"]} == {"MIXED_PRECISION_OFF"}
