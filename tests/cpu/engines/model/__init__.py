"""Tests of engines/model/."""
