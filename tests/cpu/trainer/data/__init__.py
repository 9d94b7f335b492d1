"""Tests of trainer/data/."""
