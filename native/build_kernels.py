"""cffi (API mode) build of shm_engine._kernels_cffi: W8 x A16 GEMM, norms, RoPE, paged attention.

Plain C11 + pthreads.  No -march: SIMD paths use per-function target attributes and are picked at
run time (see native/kernels/gemm16.c), so the module imports on any x86-64.
"""

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "kernels"
SOURCES = [
    "pool.c",
    "gemm16.c",
    "gemm_amx.c",
    "gemm_amx8.c",
    "gemm_a8.c",
    "gemm_w4a8.c",
    "w4.c",
    "ops.c",
    "kv_quant.c",
    "attention.c",
    "layer.c",
]


def _cdef() -> str:
    lines = (SRC / "api.h").read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "shm_engine._kernels_cffi",
    '#include "api.h"',
    # NOTE: setuptools wants paths relative to setup.py (the build runs from the repo root).
    sources=[f"native/kernels/{s}" for s in SOURCES],
    include_dirs=["native/kernels"],
    extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
