"""Synthetic benchmarks that check the papers' claims in minutes on a CPU: MQAR, copying, state tracking."""
