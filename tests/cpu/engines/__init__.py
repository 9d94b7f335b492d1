"""Tests of engines/ (engine-level here, one folder per subpackage)."""
