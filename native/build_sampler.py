"""cffi (API mode) build of shm_engine._sampler_cffi: the fused temperature / top-k / top-p / min-p
sampler (native/sampler/sample.c).

Plain C11, single-threaded per call (the cffi call releases the GIL).  No -march: the AVX2 path uses
per-function target attributes and is picked at run time, so the module imports on any x86-64.
"""

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "sampler"


def _cdef() -> str:
    lines = (SRC / "sample.h").read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "shm_engine._sampler_cffi",
    '#include "sample.h"',
    # NOTE: setuptools wants paths relative to setup.py (the build runs from the repo root).
    sources=["native/sampler/sample.c"],
    include_dirs=["native/sampler"],
    extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
