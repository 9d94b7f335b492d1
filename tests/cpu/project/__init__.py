"""Whole-project checks: docs, README, layout, import cycles, device names."""
