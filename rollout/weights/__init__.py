"""Weights: in-place updates and version counters, the transfer wire format, broadcasts to servers."""
