"""Shared by tests/ and bmv2_tests/: the reliability suite's recorder (docs/RELIABILITY.md)."""

pytest_plugins = ["switchagg_lab.testing.reliability"]
