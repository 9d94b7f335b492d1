"""Smoke tests of the benchmarks/ scripts."""
