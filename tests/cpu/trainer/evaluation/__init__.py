"""Tests of trainer/evaluation/."""
