"""Tests of trainer/tracking/."""
