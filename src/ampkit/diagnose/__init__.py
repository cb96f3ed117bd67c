"""Diagnostics: where and why low precision breaks, and what to change."""
