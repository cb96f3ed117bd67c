"""What the CPU kernels of this process may use: the hardware's instruction set, capped by torch's and
oneDNN's environment variables.

``torch.cpu._is_avx512_bf16_supported()`` and /proc/cpuinfo describe the hardware.  Two variables
cap what the kernels really run:

* ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``): ATen's vectorised kernels;
  ``torch.backends.cpu.get_cpu_capability()`` reports the level in force;
* ``ONEDNN_MAX_CPU_ISA`` (older name ``DNNL_MAX_CPU_ISA``): oneDNN, which runs the bf16 and fp16
  matmuls, and so decides whether bf16 is fast.

With ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` a CPU with AVX512-BF16 runs bf16 matmuls
like an AVX2-only laptop (about 0.03× fp32), so a probe that read only the hardware flags would
still call bf16 fast.  ``kernels_allow`` answers for the capped machine.

>>> onednn_rank("AVX2") < onednn_rank("AVX512_CORE_BF16") < onednn_rank("ALL")
True
>>> onednn_rank("avx512_core_amx") == onednn_rank("AVX10_1_512_AMX")
True
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["BF16_LEVEL", "CAP_VARIABLES", "FP16_LEVEL", "isa_caps", "kernels_allow", "onednn_rank"]

CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""The environment variables that cap the CPU kernels (recorded by `ampkit env`)."""

_ONEDNN_ORDER: dict[str, float] = {
    "SSE41": 0, "AVX": 1, "AVX2": 2, "AVX2_VNNI": 3, "AVX2_VNNI_2": 4, "AVX512_CORE": 5, "AVX512_CORE_VNNI": 6,
    "AVX512_CORE_BF16": 7, "AVX512_CORE_FP16": 8, "AVX10_1_512": 8, "AVX512_CORE_AMX": 9, "AVX10_1_512_AMX": 9,
    "AVX512_CORE_AMX_FP16": 10, "AVX10_1_512_AMX_FP16": 10, "ALL": math.inf, "DEFAULT": math.inf,
}
"""oneDNN's ISA levels in order (its ``dnnl_cpu_isa_t``); aliases share a rank."""

BF16_LEVEL = "AVX512_CORE_BF16"
"""The lowest oneDNN level with bf16 matrix instructions."""
FP16_LEVEL = "AVX512_CORE_FP16"
"""The lowest oneDNN level with fp16 matrix instructions."""


def onednn_rank(name: str) -> float:
    """The rank of a oneDNN ISA name; an unknown name ranks as no cap, as oneDNN ignores it."""
    return _ONEDNN_ORDER.get(name.strip().upper(), math.inf)


def isa_caps() -> dict[str, str | None]:
    """The cap variables as set in this process (None where unset)."""
    return {name: os.environ.get(name) for name in CAP_VARIABLES}


def kernels_allow(level: str) -> bool:
    """Whether the capped kernels may use oneDNN ISA ``level`` (``BF16_LEVEL``, ``FP16_LEVEL``) and ATen's
    AVX-512 kernels; the hardware's own support is the caller's question."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if cap is not None and onednn_rank(cap) < onednn_rank(level):
        return False
    # ATen below AVX-512 (avx2, default) also means emulated bf16/fp16 element-wise kernels.
    return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")
