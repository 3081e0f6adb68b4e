"""Benchmarks, their data generators, and the demo. Never imported by the layers below."""
