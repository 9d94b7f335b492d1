"""Tests of trainer/run/."""
