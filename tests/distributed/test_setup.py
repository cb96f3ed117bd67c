"""A precision that differs between ranks is a clear error on every rank at setup, not a hang."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_distributed_setup_mismatched_precision_raises_on_every_rank(main_run):
    _, load = main_run
    for rank in (0, 1):
        res = load("mismatch", rank)
        message = res["setup_error"]
        assert message is not None, f"rank {rank} accepted a precision that differs between ranks"
        assert "ampkit.distributed.setup: the 2 ranks disagree" in message
        assert "precision: 'bf16' on rank 0; 'fp16' on rank 1" in message
        assert "scaler: 'NoLossScaler' on rank 0; 'DynamicLossScaler' on rank 1" in message
        assert "Fix: build MixedPrecision(...) with the same arguments on every rank" in message
        assert res["group_alive"], f"rank {rank}: the process group was left unusable"


def test_distributed_shard_mismatched_precision_raises_on_every_rank(main_run):
    _, load = main_run
    for rank in (0, 1):
        message = load("mismatch", rank)["shard_error"]
        assert message is not None and "ampkit.distributed.shard: the 2 ranks disagree" in message
        assert "precision: 'bf16' on rank 0; 'fp16' on rank 1" in message
        assert "parameters:" not in message  # same architecture: only the precision is reported
