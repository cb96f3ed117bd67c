"""Shared fixtures: real `ampkit verify` jobs, run once per session (defined in tests/verify/verify_helpers.py)."""

from __future__ import annotations

from tests.verify.verify_helpers import regression_job, regression_job_again, verify_seed

__all__ = ["regression_job", "regression_job_again", "verify_seed"]
