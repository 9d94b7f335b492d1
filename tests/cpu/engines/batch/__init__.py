"""Tests of engines/batch/."""
