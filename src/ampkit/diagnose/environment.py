"""The environment block of ``ampkit.doctor/1`` reports: versions, platform, devices."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

__all__ = ["collect_environment"]


def collect_environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """Versions and devices (no benchmarks: cheap enough to call for every report).

    >>> env = collect_environment("cpu")
    >>> env["torch"] == torch.__version__ and env["device"] == "cpu"
    True
    """
    from ampkit._util.version import __version__
    from ampkit.precision import cpu_has_fast_bf16, cpu_has_fast_fp16

    env: dict[str, Any] = {
        "ampkit": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
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
