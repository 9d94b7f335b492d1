"""Tests of trainer/ (command-line level here, one folder per subpackage)."""
