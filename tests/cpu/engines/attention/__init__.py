"""Tests of engines/attention/."""
