"""``ampkit.lint.torch_writes``, the committed table of ops that write a number into a tensor, is
what ``tests/lint/gen_torch_writes.py`` makes from the pinned torch's signatures."""

from __future__ import annotations

import pytest

from ampkit.lint.torch_writes import WRITES

from .gen_torch_writes import TABLE, generate


def test_torch_writes_table_is_the_one_generated_from_the_pinned_torch() -> None:
    pytest.importorskip("torch")
    assert TABLE.read_text() == generate(), "torch's signatures changed: run python tests/lint/gen_torch_writes.py"


def test_torch_writes_table_has_every_kind_of_write_and_no_factor() -> None:
    kinds = {"masked_fill", "index_fill", "scatter", "fill_", "fill_diagonal_", "clamp", "clamp_min", "clip",
             "threshold", "hardtanh", "where", "constant_pad_nd"}
    assert kinds <= set(WRITES)
    assert not {"addcmul", "addcdiv", "histc", "add", "mul"} & set(WRITES)  # a factor or a bound is not stored
