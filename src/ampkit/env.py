"""The environment record: what a mixed-precision result depends on, in one JSON-able dict.

``collect_environment`` has two forms over the same sources:

* brief (the default): versions, platform, the device and whether this CPU is fast at
  bf16/fp16.  No subprocess, no autocast probe, no timing: cheap enough for every ``ampkit doctor``
  report, which embeds it under ``environment``.
* full (``full=True``): what ``ampkit env`` prints and ``report.json`` (``ampkit.verify/1``)
  stores under ``environment``: interpreter, torch build (CUDA/cuDNN/HIP), GPU driver, CPU model
  and the ISA flags that decide whether bf16/fp16 are fast on this CPU, GPU names and
  capabilities, thread counts, the dtypes autocast accepts on each device, and — with
  ``measure=True`` — the measured matmul throughput per dtype per device
  (``ampkit._util.speed.matmul_tflops``: interleaved, median of rounds; about a second per device).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from ampkit._util.dtypes import dtype_name
from ampkit._util.isa import isa_caps
from ampkit._util.speed import matmul_tflops
from ampkit._util.version import __version__
from ampkit.precision import cpu_has_fast_bf16, cpu_has_fast_fp16

__all__ = ["CPU_FLAGS", "collect_environment", "format_environment"]

CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16", "f16c", "avx512f", "avx2")
"""/proc/cpuinfo flags that decide how fast bf16/fp16 run on a CPU (bf16: AVX512-BF16 or AMX-BF16;
fp16: AVX512-FP16 or AMX-FP16; F16C only converts)."""

def _cpuinfo() -> tuple[str | None, set[str]]:
    model: str | None = None
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    if model is None:
        model = platform.processor() or None
    return model, flags


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        devices.append(torch.device("xpu"))
    if torch.backends.mps.is_available():
        devices.append(torch.device("mps"))
    return devices


def _autocast_dtypes(device_type: str) -> dict[str, Any]:
    """Dtypes ``torch.autocast`` actually enables on ``device_type`` (it warns and disables otherwise)."""
    supported = []
    for dtype in (torch.bfloat16, torch.float16):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autocast(device_type=device_type, dtype=dtype):
                    enabled = torch.is_autocast_enabled(device_type)
            except (RuntimeError, ValueError):
                enabled = False
        if enabled and not any("autocast" in str(w.message).lower() for w in caught):
            supported.append(dtype_name(dtype))
    default = None
    with contextlib.suppress(RuntimeError, ValueError, AttributeError):
        default = dtype_name(torch.get_autocast_dtype(device_type))
    return {"default": default, "supported": supported}


def _gpu(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "device": str(device),
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
            "bf16_supported": bool(torch.cuda.is_bf16_supported()),
        }
    return {"device": str(device), "name": device.type}


def collect_environment(device: str | torch.device | None = None, *, full: bool = False, measure: bool = False,
                        matmul_n: int = 512) -> dict[str, Any]:
    """The environment record, brief or full (see the module docstring).

    Args:
        device: the device the run uses, recorded as ``device`` (brief: ``"cpu"`` when None).
        full: every device, the CPU's ISA flags, threads and autocast dtypes (``ampkit env``).
        measure: also time a ``matmul_n``-sized matmul per dtype on every device (implies ``full``).

    >>> brief = collect_environment("cpu")
    >>> brief["torch"] == torch.__version__ and brief["device"] == "cpu"
    True
    >>> env = collect_environment(full=True)
    >>> env["torch"] == torch.__version__, "cpu" in env["autocast"], "matmul_tflops" in env
    (True, True, False)
    """
    if not (full or measure):
        return _brief(device)
    env = _full()
    if device is not None:
        env["device"] = str(device)
    if measure:
        env["matmul_tflops"] = {
            str(d): {dtype_name(dt): float(f"{v:.4g}") for dt, v in matmul_tflops(device=d, n=matmul_n).items()}
            for d in _devices()
        }
        env["matmul_n"] = matmul_n
    return env


def _brief(device: str | torch.device | None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "ampkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": str(device) if device is not None else "cpu",
        "cpu_fast_bf16": cpu_has_fast_bf16(),
        "cpu_fast_fp16": cpu_has_fast_fp16(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def _full() -> dict[str, Any]:
    model, flags = _cpuinfo()
    devices = _devices()
    return {
        "ampkit": __version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "hip": getattr(torch.version, "hip", None),
        "nvidia_driver": _nvidia_driver() if torch.cuda.is_available() else None,
        "cpu": {
            "model": model,
            "machine": platform.machine(),
            "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "flags": {flag: flag in flags for flag in CPU_FLAGS},
            "fast_bf16": cpu_has_fast_bf16(),
            "fast_fp16": cpu_has_fast_fp16(),
            # Set caps make the kernels (and fast_bf16/fast_fp16) those of a smaller CPU than the flags say.
            "kernel_caps": {k: v for k, v in isa_caps().items() if v is not None},
        },
        "threads": {
            "intra_op": torch.get_num_threads(),
            "inter_op": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "gpus": [_gpu(d) for d in devices if d.type != "cpu"],
        "autocast": {t: _autocast_dtypes(t) for t in dict.fromkeys(d.type for d in devices)},
        "numpy": _version("numpy"),
    }


def _version(module: str) -> str | None:
    mod = sys.modules.get(module)
    if mod is None:
        with contextlib.suppress(ImportError):
            mod = __import__(module)
    return getattr(mod, "__version__", None)


def format_environment(env: dict[str, Any]) -> str:
    """Plain-text rendering for terminals and bug reports (the JSON form is ``--json``)."""
    cpu = env["cpu"]
    caps = cpu.get("kernel_caps") or {}
    lines = [
        f"ampkit   {env['ampkit']}",
        f"python   {env['python']} ({env['python_implementation']}) on {env['platform']}",
        f"torch    {env['torch']}  cuda={env['cuda']}  cudnn={env['cudnn']}  hip={env['hip']}"
        + (f"  driver={env['nvidia_driver']}" if env.get("nvidia_driver") else ""),
        f"cpu      {cpu['model']}  ({cpu['usable_cores']}/{cpu['logical_cores']} cores usable, "
        f"torch kernels: {cpu['torch_capability']})",
        "cpu isa  " + "  ".join(f"{k}={'yes' if v else 'no'}" for k, v in cpu["flags"].items()),
        f"         fast bf16: {'yes' if cpu['fast_bf16'] else 'no'}   fast fp16: {'yes' if cpu['fast_fp16'] else 'no'}"
        + (f"   (kernels capped: {' '.join(f'{k}={v}' for k, v in caps.items())})" if caps else ""),
        f"threads  intra-op {env['threads']['intra_op']}, inter-op {env['threads']['inter_op']}, "
        f"OMP_NUM_THREADS={env['threads']['OMP_NUM_THREADS']}",
    ]
    for gpu in env["gpus"]:
        extra = f" capability {gpu['capability']}, {gpu['memory_bytes'] / 2**30:.1f} GiB" if "capability" in gpu else ""
        lines.append(f"gpu      {gpu['device']}: {gpu['name']}{extra}")
    for dev, ac in env["autocast"].items():
        lines.append(f"autocast {dev}: default {ac['default']}, supported {', '.join(ac['supported']) or 'none'}")
    for dev, rates in env.get("matmul_tflops", {}).items():
        base = rates.get("fp32") or float("nan")
        cells = [f"{name} {v:.3f}" + ("" if name == "fp32" else f" ({v / base:.2f}x)") for name, v in rates.items()]
        lines.append(f"matmul   {dev} {env.get('matmul_n')}^3 TFLOP/s: " + "  ".join(cells))
    return "\n".join(lines)
