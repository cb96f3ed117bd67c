"""One user-facing spelling of floating-point dtypes: fp32, bf16, fp16 (never ``torch.float16``).

Messages, findings and terminal output use ``dtype_name``; JSON keys and enums keep their
contract spelling, which for the fp8 formats is ``fp8_e4m3`` / ``fp8_e5m2``.

>>> import torch
>>> dtype_name(torch.float16), dtype_name(torch.bfloat16), dtype_name(torch.float32), dtype_name("float16")
('fp16', 'bf16', 'fp32', 'fp16')
>>> dtype_name(torch.int64)
'int64'
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_NAMES", "dtype_name"]

DTYPE_NAMES: dict[str, str] = {
    "float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
    # aliases torch and its C++ error messages use for the same dtypes
    "double": "fp64", "float": "fp32", "half": "fp16", "c10::half": "fp16", "at::half": "fp16",
    "c10::bfloat16": "bf16", "at::bfloat16": "bf16",
}
"""Lower-case torch dtype names (``str(dtype)`` without ``torch.``) and aliases -> the short name."""


def dtype_name(dtype: Any) -> str:
    """The short name of a ``torch.dtype`` or a dtype's string spelling; other dtypes keep theirs.

    Takes strings too (``"torch.float16"``, ``"Half"``), so error-message parsers share it
    without importing torch.
    """
    if dtype is None:
        return "none"
    text = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(text.lower(), text)
