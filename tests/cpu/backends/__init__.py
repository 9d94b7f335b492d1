"""Tests of backends/."""
