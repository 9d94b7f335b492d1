"""Hydra configuration files for polyfsdp, found as ``pkg://polyfsdp.configs``."""
