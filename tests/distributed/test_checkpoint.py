"""Resume: in process from a DDP file, and after SIGKILL for DDP (file) and FSDP2 (DCP)."""

from __future__ import annotations

import pytest

from ._dist_testlib import differing

pytestmark = pytest.mark.slow

CKPT_STEP = 10


def test_distributed_ddp_checkpoint_resumes_bitwise_in_process(main_run):
    _, load = main_run
    for rank in (0, 1):
        ref = load("resume_reference", rank)["ddp"]
        again = ref["in_process_resume"]
        assert again["loss"] == ref["loss"][CKPT_STEP:]
        assert again["scale"] == ref["scale"][CKPT_STEP:]
        assert differing(again["params"], ref["params"]) == []


def test_distributed_ddp_checkpoint_per_rank_rng_is_what_makes_dropout_resume(main_run):
    _, load = main_run
    ref = load("resume_reference", 1)["ddp"]
    # Control for the test above: resuming without the saved per-rank RNG states diverges.
    assert differing(ref["resume_without_rng"]["params"], ref["params"]) != []


def test_distributed_resume_after_sigkill_launch_lost_rank1_after_the_checkpoint(kill_and_resume):
    killed, _, _, out = kill_and_resume
    assert killed.ranks[1].signal == "SIGKILL", killed.describe()
    assert "fsdp: checkpoint at step 10" in killed.ranks[1].stdout
    assert killed.ranks[0].exitcode != 0  # torchrun stops the survivor, or its collective fails
    assert (out / "ckpt" / "ddp.pt").is_file() and (out / "ckpt" / "fsdp" / "ampkit.pt").is_file()


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_distributed_resume_after_sigkill_continues_bitwise(kill_and_resume, main_run, kind):
    _, _, load_resumed, _ = kill_and_resume
    _, load_main = main_run
    for rank in (0, 1):
        ref = load_main("resume_reference", rank)[kind]
        resumed = load_resumed("resume", rank)[kind]
        assert resumed["loss"] == ref["loss"][CKPT_STEP:], f"rank {rank}: losses after resume differ"
        assert resumed["found_inf"] == ref["found_inf"][CKPT_STEP:], f"rank {rank}: skip decisions differ"
        assert resumed["scale"] == ref["scale"][CKPT_STEP:], f"rank {rank}: loss scales differ"
        assert differing(resumed["params"], ref["params"]) == [], f"rank {rank}: parameters differ at step 20"
    # The fp16 scaler changes scale during the resumed steps, so its state had to round-trip.
    assert len(set(ref["scale"][CKPT_STEP:])) > 1 and any(ref["found_inf"][CKPT_STEP:])


def test_distributed_fsdp_checkpoint_round_trips_the_scaler_state(kill_and_resume, main_run):
    _, _, load_resumed, _ = kill_and_resume
    engine = load_resumed("resume", 0)["fsdp"]["engine_after_load"]
    assert engine["optimizer_steps"] == CKPT_STEP
    ref = load_resumed("resume", 1)["fsdp"]["engine_after_load"]
    assert engine == ref  # stored once, loaded identically on every rank
    assert engine["scaler"]["growth_interval"] == 3
    assert engine["scaler"]["scale"] == main_run[1]("resume_reference", 0)["fsdp"]["scale"][CKPT_STEP]


def test_distributed_fsdp_checkpoint_survives_a_kill_during_overwrite(kill_and_resume):
    _, _, load_resumed, _ = kill_and_resume
    fsdp = load_resumed("resume", 0)["fsdp"]
    # The kill left the half-written shards in .fsdp.partial; the checkpoint itself stayed the
    # step-10 one (the resume above is bitwise), and the next save cleared the leftovers.
    assert fsdp["partial_left_by_kill"]
    assert not fsdp["partial_left_after_save"]
