"""The kernels' instruction set as this process may use it: hardware flags capped by the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ampkit._util.isa import BF16_LEVEL, FP16_LEVEL, isa_caps, kernels_allow, onednn_rank


def test_isa_onednn_rank_orders_levels_and_ignores_unknown_names() -> None:
    assert onednn_rank("sse41") < onednn_rank("AVX2") < onednn_rank("AVX512_CORE") < onednn_rank(BF16_LEVEL)
    assert onednn_rank(BF16_LEVEL) < onednn_rank(FP16_LEVEL) < onednn_rank("AVX512_CORE_AMX")
    assert onednn_rank("no-such-isa") == onednn_rank("ALL") == float("inf")


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_isa_onednn_cap_below_a_level_forbids_it(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(variable, "AVX2")
    assert not kernels_allow(BF16_LEVEL) and not kernels_allow(FP16_LEVEL)
    monkeypatch.setenv(variable, "AVX512_CORE_BF16")
    assert not kernels_allow(FP16_LEVEL)
    assert kernels_allow(BF16_LEVEL) == torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def test_isa_caps_lists_only_what_this_process_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    caps = isa_caps()
    assert caps["ONEDNN_MAX_CPU_ISA"] == "AVX2" and caps["DNNL_MAX_CPU_ISA"] is None


def _probe(env: dict[str, str]) -> dict[str, object]:
    code = ("import json, torch; from ampkit.precision import Precision, cpu_has_fast_bf16; "
            "print(json.dumps({'fast_bf16': cpu_has_fast_bf16(), 'auto': Precision.parse('auto', 'cpu').name, "
            "'capability': torch.backends.cpu.get_cpu_capability()}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_isa_emulated_avx2_cpu_is_seen_by_the_probe_and_auto() -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    emulated = _probe({**base, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert emulated == {"fast_bf16": False, "auto": "fp32", "capability": "AVX2"}


def test_isa_env_record_names_the_caps_in_force() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = "from ampkit.cli.main import main; raise SystemExit(main(['env', '--json']))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cpu = json.loads(out.stdout)["cpu"]
    assert cpu["kernel_caps"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert cpu["fast_bf16"] is False and cpu["torch_capability"] == "AVX2"
