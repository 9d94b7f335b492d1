"""Tests of engines/parallel/."""
