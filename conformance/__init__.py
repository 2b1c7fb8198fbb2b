"""Conformance suite: the cases every backend must pass (suite.py), their bounds (thresholds.py), the pytest plugin."""
