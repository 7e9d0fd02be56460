"""Rebuild native modules in place during development (pip install -e . does the same for users).

Usage: python scripts/build_native.py [ring|kernels|sampler ...] (default: every native/build_*.py)
Each build script lives at native/build_<name>.py and defines ``ffibuilder``.
"""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def build(name: str) -> pathlib.Path:
    script = ROOT / "native" / f"build_{name}.py"
    spec = importlib.util.spec_from_file_location(f"_build_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # NOTE: unlink (not overwrite) the old module: processes that have it mapped keep the old
    # inode, where writing over it in place would crash them.
    for old in (ROOT / "shm_engine").glob(f"_{name}_cffi.*.so"):
        old.unlink()
    # NOTE: cffi compiles inside tmpdir; with the repo root there, the sources' root-relative paths
    # resolve and the module lands in shm_engine/ directly (generated .c and .o are git-ignored).
    return pathlib.Path(module.ffibuilder.compile(tmpdir=str(ROOT)))


if __name__ == "__main__":
    names = sys.argv[1:] or [
        p.stem.removeprefix("build_") for p in (ROOT / "native").glob("build_*.py")
    ]
    for n in names:
        print(build(n))
