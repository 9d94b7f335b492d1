"""Tests of engines/losses/."""
