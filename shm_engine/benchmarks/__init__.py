"""Benchmarks shipped with the package.

serve and ipc run through `shm-engine bench serve` / `shm-engine bench ipc`; frontend_overhead
with `python -m shm_engine.benchmarks.frontend_overhead`.
"""
