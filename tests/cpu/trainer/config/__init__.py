"""Tests of trainer/config/."""
