"""Benchmarks: throughput as ratios against baselines measured in the same run."""
