"""Metrics and timelines of a run."""
