"""The environment record: the brief form the doctor embeds and the full form `ampkit env` prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ampkit.env import CPU_FLAGS, collect_environment


def test_env_record_reads_the_cpu_flags_from_proc_cpuinfo() -> None:
    env = collect_environment(full=True)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this platform")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert env["cpu"]["flags"] == {f: f in flags for f in CPU_FLAGS}
    assert env["threads"]["intra_op"] == torch.get_num_threads()
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert "matmul_tflops" not in env


def test_env_autocast_dtypes_list_what_autocast_enables_on_cpu() -> None:
    env = collect_environment(full=True)
    assert env["autocast"]["cpu"]["default"] == "bf16"
    assert "bf16" in env["autocast"]["cpu"]["supported"]


def test_env_brief_record_has_the_doctor_keys_and_no_probing() -> None:
    env = collect_environment("cpu")
    keys = ["ampkit", "torch", "python", "platform", "machine", "device", "cpu_fast_bf16", "cpu_fast_fp16", "cuda"]
    assert list(env)[: len(keys)] == keys and set(env) <= {*keys, "cuda_devices"}
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert collect_environment()["device"] == "cpu"


def test_env_full_record_names_the_device_only_when_given() -> None:
    assert "device" not in collect_environment(full=True)
    assert collect_environment("cpu", full=True)["device"] == "cpu"
