"""Tests of engines/checkpoint/."""
