"""Pytest fixtures shared by the test suite (registered in tests/conftest.py)."""
