from __future__ import annotations

import ast
import os
import random
import re
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS = Path(__file__).resolve().parent
BENCHMARKS = TESTS.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    # The GPU check's modules (gpucheck) and the benchmark scripts live in benchmarks/, not in an
    # installed package; the GPU check's tests and the fp8 recipe test import them from there.
    sys.path.insert(0, str(BENCHMARKS))


def _inductor_cache_per_isa() -> None:
    """Give the suite's torch.compile calls a cache directory of their own per kernel cap.

    inductor's cache key does not include ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``: a kernel
    compiled for AVX-512 is loaded by the emulated AVX2 run (and the reverse), which then fails or
    aborts.  Set before any compile; rank and worker subprocesses inherit it.
    """
    caps = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    slug = re.sub(r"[^A-Za-z0-9=_-]", "_", "-".join(caps) or "native")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(tempfile.gettempdir()) / f"ampkit-tests-inductor-{os.getuid()}-{slug}"))


_inductor_cache_per_isa()


def _children_start_with_default_signals() -> None:
    """Let the processes the signal tests start react to SIGINT and SIGHUP again.

    A run started in the background of a non-interactive shell gets SIGINT ignored, one started under
    ``nohup`` gets SIGHUP ignored, and an ignored disposition survives ``exec``: every child would shrug
    the test's signal off and the test would wait out its timeout (a minute each).  A handler, unlike an
    ignore, is reset to the default on ``exec``.  SIGINT gets Python's own handler (what a terminal run
    has, and what the in-process signal tests expect); SIGHUP a handler that does nothing, so this run
    still survives a hang-up as ``nohup`` asked.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda signum, frame: None)


_children_start_with_default_signals()


NUMERICS: dict[str, tuple[str, ...] | None] = {
    # The doctor's failure corpus and the doctors' verdicts: overflow, NaN birth, SQNR, culprits.
    "diagnose/test_doctor_cases.py": (
        "test_doctor_cases_script_reports_expected_codes_and_culprit",
        "test_doctor_cases_fixed_variant_has_no_error_and_none_of_the_codes",
        "test_doctor_cases_results_match_stored_expectations",
    ),
    "diagnose/test_task.py": None,
    "diagnose/test_replay.py": None,
    "diagnose/core/test_perf.py": None,
    "diagnose/core/test_stats.py": None,
    "diagnose/live/test_doctor.py": None,
    "diagnose/report/test_agreement.py": None,
    "diagnose/step/test_api.py": None,
    "diagnose/step/test_backward.py": None,
    "diagnose/step/test_bisect.py": None,
    "diagnose/step/test_compare.py": None,
    "diagnose/step/test_compiled.py": None,
    "diagnose/step/test_effect.py": None,
    "diagnose/step/test_events.py": None,
    "diagnose/step/test_fp8.py": None,
    "diagnose/step/test_nanorigin.py": None,
    "diagnose/step/test_trace.py": None,
    "diagnose/script/test_checkup.py": None,
    "diagnose/script/test_context.py": None,
    "diagnose/script/test_errors.py": None,
    "diagnose/script/test_first_forward.py": None,
    "diagnose/script/test_lossgrad.py": None,
    "diagnose/script/test_losstrace.py": None,
    "diagnose/script/test_models.py": None,
    "diagnose/script/test_op_location.py": None,
    "diagnose/script/test_step_numbering.py": None,
    "diagnose/script/test_threads.py": None,
    "diagnose/script/watchers/test_backward.py": None,
    "diagnose/script/watchers/test_compile.py": None,
    "diagnose/script/watchers/test_engine.py": None,
    "diagnose/script/watchers/test_optim.py": None,
    "diagnose/script/watchers/test_penalty.py": None,
    "diagnose/script/watchers/test_scaler.py": None,
    "diagnose/script/test_runner.py": (
        "test_doctor_script_leaves_the_training_bit_identical",
        "test_doctor_script_leaves_an_eval_forward_after_the_loss_code_bit_identical",
        "test_doctor_script_names_the_op_whose_backward_raised_a_dtype_mismatch",
        "test_doctor_script_observes_a_compiled_model",
        "test_doctor_script_precision_option_checks_an_fp32_script",
        "test_doctor_script_replays_a_forward_whose_masked_outputs_went_nan",
        "test_doctor_script_scale_collapse_from_a_derivative_singularity_names_it",
    ),
    "cli/test_doctor.py": ("test_doctor_compare_compiled_reports_only_the_module_that_differs",),
    "integrations/test_doctor_frameworks.py": (
        "test_doctor_frameworks_script_reports_the_plain_loop_code_and_culprit",
        "test_doctor_frameworks_fixed_variant_has_no_error",
        "test_doctor_frameworks_trainer_bf16_json_holds_precision_and_fp32_comparison",
        "test_doctor_frameworks_fp16_autocast_inside_forward_replays_in_fp16",
        "test_doctor_frameworks_ampkit_precision_skipped_steps_are_the_engines",
    ),
    # Telemetry's values: counts, norms, scale and skips, fp8 operand statistics.
    "telemetry/test_alarms.py": None,
    "telemetry/test_core.py": None,
    "telemetry/test_fp8stats.py": None,
    "telemetry/test_fp8alarm.py": ("test_fp8_flush_alarm_in_training_fires_on_rising_input_flush",),
    "telemetry/test_metrics.py": None,
    "telemetry/test_observe.py": None,
    "telemetry/test_refused_backward.py": None,
    "telemetry/test_sparse_grads.py": None,
    "telemetry/test_step_cost.py": None,
    # verify's verdicts on real runs, and its speed verdict.
    "cli/test_verify.py": (
        "test_verify_passing_task_exits_0_and_writes_three_files",
        "test_verify_same_seed_gives_identical_loss_arrays",
        "test_verify_fp16_overflow_fails_and_exits_1",
        "test_verify_low_precision_slower_than_fp32_passes_with_the_no_speedup_note",
    ),
    "verify/test_noise.py": (
        "test_a_low_precision_within_a_narrow_band_passes_and_exits_0",
        "test_the_noise_run_shares_the_weights_but_not_the_data_order",
        "test_a_wide_band_makes_a_matching_low_precision_inconclusive_and_exits_3",
        "test_a_real_bf16_failure_beyond_the_band_fails_and_exits_1",
        "test_ten_steps_of_tinygpt_are_inconclusive",
    ),
    "verify/test_launch.py": (
        "test_verify_nproc_runs_every_precision_on_2_ranks_and_validates",
        "test_verify_nproc_first_loss_equals_one_process",
    ),
    "verify/test_fp8_verify.py": None,
    # The GPU check's sections run on the CPU too: bit-exactness, ratios, the replay's culprit.
    "bench/test_gpu_check_sections.py": None,
    "bench/test_gpu_check_fp8.py": None,
    # The engine against torch's own recipes, bit for bit, and its skips on overflow.
    "test_engine.py": None,
    "test_engine_bitexact.py": None,
    "test_engine_complex.py": None,
    "test_engine_fp8.py": None,
    "test_engine_nosync.py": None,
    "test_engine_skip.py": None,
    "test_scaler.py": None,
    "test_policy.py": None,
    "test_compile.py": None,
    "test_checkpoint.py": (
        "test_checkpoint_round_trip_restores_model_optimizer_engine_and_grads",
        "test_checkpoint_resume_after_sigkill_is_bit_identical",
        "test_checkpoint_fp8_resume_after_sigkill_is_bit_identical",
    ),
    # What the CPU may run, as the capability probe and `auto` see it.
    "test_precision.py": None,
    "test_env.py": None,
    "_util/test_isa.py": None,
}
"""The tests that judge numbers the CPU's kernels decide (precision, SQNR, overflow, bit-exactness
against the recipe, speed ratios and verdicts): a module of tests/ (None: all its tests) or the named
tests of it.  They carry the ``numerics`` marker, and `make test-avx2` runs them again on an emulated
AVX2-only CPU, where bf16 and fp16 are emulated and slow.  Process, I/O, signal, CLI-input and
rendering tests judge no kernel's numbers and run once, in the native leg; a test module can also
mark itself (``pytestmark = pytest.mark.numerics``).  tests/test_suite.py keeps every entry naming a
test that exists."""


def numerics_table_stale() -> list[str]:
    """Entries of NUMERICS that name no test module, or no test function of their module."""
    stale = []
    for rel, names in NUMERICS.items():
        path = TESTS / rel
        if not path.is_file():
            stale.append(rel)
            continue
        defined = {node.name for node in ast.parse(path.read_text(encoding="utf-8")).body
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        stale += [f"{rel}::{n}" for n in names or () if n not in defined]
    return stale


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        rel = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None
        if rel in NUMERICS:
            names = NUMERICS[rel]
            if names is None or getattr(item, "originalname", item.name) in names:
                item.add_marker(pytest.mark.numerics)


@pytest.fixture
def seed() -> int:
    """Seed every RNG the tests touch; returns the seed."""
    value = 1234
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value
