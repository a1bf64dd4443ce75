"""Helpers for tests and benchmarks: the tiny model, a real vLLM server process, pytest fixtures."""
