"""Tests of patches/."""
