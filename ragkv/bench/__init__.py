"""Benchmarks (never timed tests): each prints ratios against a baseline measured in the same run and saves JSON."""
