"""Tests of trainer/algos/."""
