"""Benchmarks of mixers and models."""
