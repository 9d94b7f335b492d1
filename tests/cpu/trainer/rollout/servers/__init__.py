"""Tests of trainer/rollout/servers/."""
