"""Benchmarks run by the `sluice bench` command."""
