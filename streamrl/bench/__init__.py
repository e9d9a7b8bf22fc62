"""Benchmark commands (``streamrl bench ...``): ratios measured in one invocation."""
