"""Benchmarks shipped with the package (run through `shm-engine bench ...`)."""
