"""Tests of engines/head/."""
