"""Benchmark tools shipped with infire: `infire bench serve` (serve.py, plot.py)."""
