"""Tests of engines/jagged/."""
