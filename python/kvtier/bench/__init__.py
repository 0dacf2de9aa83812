"""Benchmarks that need Python and PyTorch: ``python -m kvtier.bench.ttft`` (time to first token
on the GPU, recompute vs a prefix loaded from kvtier)."""
