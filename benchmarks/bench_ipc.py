"""IPC micro-benchmark (the ring vs pyzmq vs multiprocessing.Pipe): see shm_engine/benchmarks/ipc.py.

    python -m benchmarks.bench_ipc [--quick] [--json PATH]     (or: shm-engine bench ipc ...)

The benchmark lives in the package so that ``shm-engine bench ipc`` works from any directory;
this script stays for the commands recorded in RESULTS.md.
"""

from __future__ import annotations

import sys

from shm_engine.benchmarks.ipc import main

if __name__ == "__main__":
    sys.exit(main())
