"""Tests of ampkit.telemetry, one module per source module."""
