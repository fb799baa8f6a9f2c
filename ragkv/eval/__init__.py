"""Evaluation: data set loaders, metrics, resumable results, harness and benchmarks."""
