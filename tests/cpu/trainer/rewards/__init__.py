"""Tests of trainer/rewards/."""
