"""Helpers for tests and benchmarks: tiny local checkpoints, real-model configs for dummy weights."""
