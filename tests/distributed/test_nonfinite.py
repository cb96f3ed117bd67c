"""A NaN on one rank only: every rank skips the same step and the replicas stay identical."""

from __future__ import annotations

import math

import pytest

from ._dist_testlib import differing

pytestmark = pytest.mark.slow

NAN_STEP = 7
RANKS = (0, 1)


def _check_skip_on_every_rank(runs: list[dict], body_only: bool = False) -> None:
    for rank, run in enumerate(runs):
        watch = run["watch"]
        assert run["found_inf"][NAN_STEP] > 0 and watch["skipped"], f"rank {rank} applied step {NAN_STEP}"
        changed = [n for n, same in watch["unchanged"].items() if not same and not (body_only and n.startswith("head."))]
        assert not changed, f"rank {rank} changed {changed} at the skipped step {NAN_STEP}"
    assert runs[0]["found_inf"] == runs[1]["found_inf"], "the ranks took different skip decisions"
    assert runs[0]["scale"] == runs[1]["scale"], "the ranks' loss scales diverged"


def test_distributed_ddp_nan_on_rank1_batch_skips_step7_on_both_ranks(main_run):
    _, load = main_run
    runs = [load("ddp_nan", r) for r in RANKS]
    assert math.isnan(runs[1]["loss"][NAN_STEP]) and math.isfinite(runs[0]["loss"][NAN_STEP])
    _check_skip_on_every_rank(runs)
    # fp16: the skip also backed off the scale, identically on both ranks.
    assert runs[0]["scale"][NAN_STEP + 1] == runs[0]["scale"][NAN_STEP] / 2


def test_distributed_ddp_nan_params_bitwise_identical_across_ranks_after_20_steps(main_run):
    _, load = main_run
    runs = [load("ddp_nan", r) for r in RANKS]
    assert len(runs[0]["loss"]) == 20
    assert differing(runs[0]["params"], runs[1]["params"]) == []
    assert all(t.isfinite().all() for t in runs[0]["params"].values())


def test_distributed_ddp_nan_first_nonfinite_rank_names_rank1(main_run):
    _, load = main_run
    runs = [load("ddp_nan", r) for r in RANKS]
    # DDP's all-reduce put the NaN into rank 0's gradients too; the loss names the origin.
    assert runs[0]["watch"]["grads_nonfinite"] and not runs[0]["watch"]["loss_nonfinite"]
    assert [run["watch"]["first_nonfinite_rank"] for run in runs] == [1, 1]


def test_distributed_fsdp_nan_on_rank1_batch_skips_step7_on_both_ranks(main_run):
    _, load = main_run
    runs = [load("fsdp_nan", r) for r in RANKS]
    assert math.isnan(runs[1]["loss"][NAN_STEP]) and math.isfinite(runs[0]["loss"][NAN_STEP])
    _check_skip_on_every_rank(runs)
    assert [run["watch"]["first_nonfinite_rank"] for run in runs] == [1, 1]


def test_distributed_fsdp_nan_params_identical_across_ranks_and_equal_to_a_run_without_step7(main_run):
    _, load = main_run
    runs = [load("fsdp_nan", r) for r in RANKS]
    assert differing(runs[0]["params"], runs[1]["params"]) == []
    # Sharded parameters are gathered to compare; the strong check is against a reference
    # run that never saw step 7: any rank that had applied it would differ.
    assert differing(runs[0]["params"], runs[0]["reference_params"]) == []


def test_distributed_fsdp_rank_holding_empty_shards_still_steps_and_skips(main_run):
    _, load = main_run
    runs = [load("fsdp_nan", r) for r in RANKS]
    # head.weight is (1, 32) and head.bias (1,): on 2 ranks, rank 1 holds none of them.
    assert runs[0]["head_local_numel"] == [32, 1]
    assert runs[1]["head_local_numel"] == [0, 0]
    assert runs[1]["watch"]["unchanged"]["head.weight"] and runs[1]["watch"]["skipped"]


def test_distributed_fsdp_overflow_in_one_rank_shard_skips_on_every_rank(main_run):
    _, load = main_run
    runs = [load("fsdp_shard_nan", r) for r in RANKS]
    # Only rank 1's shard held the inf: rank 0's own check was clean, the all-reduce made it skip.
    assert not runs[0]["watch"]["grads_nonfinite"] and runs[1]["watch"]["grads_nonfinite"]
    assert not runs[0]["watch"]["loss_nonfinite"] and not runs[1]["watch"]["loss_nonfinite"]
    # The body optimizer skipped on both ranks; the head's own optimizer was clean and stepped
    # (per-optimizer decisions, as torch.amp.GradScaler makes them).
    _check_skip_on_every_rank(runs, body_only=True)
    assert runs[0]["scale"][NAN_STEP + 1] == runs[0]["scale"][NAN_STEP] / 2
    assert [run["watch"]["first_nonfinite_rank"] for run in runs] == [1, 1]
    assert differing(runs[0]["params"], runs[1]["params"]) == []
