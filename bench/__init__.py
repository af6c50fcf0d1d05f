"""Benchmarks: the model zoo (bench.models) and the runner (bench/run.py)."""
