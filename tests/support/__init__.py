"""Helpers for the test suite: real processes the tests start and stop themselves."""
