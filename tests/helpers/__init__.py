"""Helpers shared by the tests (importable as ``helpers`` from tests/)."""
