"""Helpers for tests and examples: tiny random models of each family, built in-process."""
