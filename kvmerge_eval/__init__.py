"""Evaluation tasks and the benchmark runner (outside the library core)."""
