"""Section ``verify``: ``ampkit verify`` on a GPU-sized tinygpt, fp32 against bf16 and fp16 (reported, not judged).

On CUDA the precisions are verify's defaults there (fp32, bf16, fp16), so the check also shows that
fp16 is in the default set.  Per precision it reports the speed-up over fp32, the peak-memory
ratio (``torch.cuda.max_memory_allocated``), tokens/s and verify's own verdict; for bf16 also the
model FLOPs utilisation against the device's published dense bf16 peak (``PEAK_BF16_TFLOPS``):

    MFU = tokens/s x (6 N + 12 L d T) / peak

with N the parameter count, L layers, d the width and T the context (the attention matmuls; PaLM's
appendix B).  The report files land in ``OUT/verify/``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpucheck.checks import Check, check

__all__ = ["PEAK_BF16_TFLOPS", "flops_per_token", "peak_bf16_tflops", "run"]

PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.05,
    "L4": 121.0,
    "A10": 125.0,
    "RTX 4090": 165.2,
    "RTX 3090": 71.0,
}
"""Dense (no sparsity) bf16 tensor-core peak in TFLOP/s, from each vendor data sheet, keyed by a part
of the device name; the longest key found in the name wins ("H100 PCIe" before "H100")."""


def peak_bf16_tflops(device_name: str) -> tuple[str, float] | None:
    """(key, TFLOP/s) of the longest ``PEAK_BF16_TFLOPS`` key in ``device_name``, or None.

    >>> peak_bf16_tflops("NVIDIA H100 PCIe")
    ('H100 PCIe', 756.0)
    >>> peak_bf16_tflops("NVIDIA GeForce GTX 1080") is None
    True
    """
    found = [k for k in PEAK_BF16_TFLOPS if k in device_name]
    if not found:
        return None
    key = max(found, key=len)
    return key, PEAK_BF16_TFLOPS[key]


def flops_per_token(task: Any) -> float:
    """Training FLOPs per token of the task's GPT: 6 N + 12 L d T (the model is built on the meta device)."""
    cfg = task.config
    with torch.device("meta"):
        model = task.build_model(0)
    n = sum(p.numel() for p in model.parameters())
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.block_size


def _x(value: float | None, unit: str, fmt: str = ".3g") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


def _summary(m: dict[str, Any]) -> str:
    """One line: ``speed-up 2.1x, peak memory 0.62x fp32, 1.2e+05 tokens/s, MFU 41%, verify pass``."""
    parts = [f"speed-up {_x(m['speedup_vs_fp32'], 'x')}", f"peak memory {_x(m['peak_memory_vs_fp32'], 'x')} fp32",
             f"{_x(m['tokens_per_s'], ' tokens/s')}"]
    if "mfu" in m:
        peak = m["peak_bf16_tflops"]
        parts.append(f"MFU {_x(None if m['mfu'] is None else 100 * m['mfu'], '%', '.1f')}"
                     + (f" of {peak['tflops']:g} TFLOP/s ({peak['key']})" if peak else " (no published peak for this device)"))
    parts.append(f"verify {m['verdict']}")
    return ", ".join(parts)


def _task_ref(tiny: bool) -> str:
    return f"{Path(__file__).with_name('verify_task.py')}:{'tiny' if tiny else 'full'}"


def run(device: torch.device, *, tiny: bool, out: Path) -> Iterator[Check]:
    from ampkit.tasks import load_task
    from ampkit.verify.harness import VerifyConfig, run_verify
    from ampkit.verify.report import write_report

    ref = _task_ref(tiny)
    # verify's defaults on an accelerator include fp16; on the CPU they do not, so name it there.
    precisions = None if device.type != "cpu" else ("bf16", "fp16")
    report = run_verify(VerifyConfig(task=ref, device=str(device), precisions=precisions, measure_env=not tiny))
    write_report(report, out / "verify")
    task = load_task(ref)
    per_token = flops_per_token(task)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16_tflops(name)
    runs = {r["precision"]: r for r in report["runs"]}
    fp32 = runs.get("fp32", {})
    for precision, r in runs.items():
        entry: dict[str, Any] = next((c for c in report["comparison"] if c["precision"] == precision), {})
        tokens = (r.get("throughput") or {}).get("tokens_per_s")
        measured: dict[str, Any] = {
            "status": r.get("status"),
            "tokens_per_s": tokens,
            "speedup_vs_fp32": entry.get("speedup"),
            "peak_memory_bytes": r.get("peak_memory_bytes"),
            "peak_memory_vs_fp32": (r["peak_memory_bytes"] / fp32["peak_memory_bytes"]
                                    if r.get("peak_memory_bytes") and fp32.get("peak_memory_bytes") else None),
            "verdict": entry.get("verdict"),
        }
        if precision == "bf16":
            measured["mfu"] = tokens * per_token / (peak[1] * 1e12) if tokens and peak else None
            measured["peak_bf16_tflops"] = {"device": name, "key": peak[0], "tflops": peak[1]} if peak else None
        detail = _summary(measured)
        status_ok = r.get("status") == "ok"
        c = check("verify.run", precision, measured, detail if status_ok else f"run {r.get('status')}: {r.get('error')}",
                  memory_kind=(r.get("memory") or {}).get("kind"), flops_per_token=per_token,
                  default_precisions=precisions is None, precisions=report["protocol"]["precisions"])
        if not status_ok:
            c.status = "error"
        yield c
