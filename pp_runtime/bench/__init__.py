"""Measuring a running server: the load generator and the capacity search."""
