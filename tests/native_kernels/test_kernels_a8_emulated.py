"""gemm_a8.c's VNNI kernel on a CPU without AVX-512: compiled against SIMDe's emulation of the
intrinsics (emulated/), it must give its portable twin's bits (quantiser and GEMM, ragged
shapes, edge rows, 1 and 2 threads' splits, bias, accumulation; 768 cases). Runs where the SIMDe headers
are installed (Debian: libsimde-dev); on VNNI CPUs test_kernels_gemm_a8.py checks the real
instructions."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "native" / "kernels"
HERE = Path(__file__).resolve().parent / "emulated"

pytestmark = pytest.mark.skipif(
    not Path("/usr/include/simde/x86/avx512.h").exists() or shutil.which("gcc") is None,
    reason="needs gcc and the SIMDe headers (libsimde-dev)",
)


def test_a8_vnni_kernel_matches_portable_under_emulation(tmp_path):
    for name in ("gemm_a8.c", "vnni_tile.h", "common.h", "api.h"):
        text = (KERNELS / name).read_text()
        # NOTE: no target attributes: gcc would emit real AVX-512 for the emulation's code
        (tmp_path / name).write_text(re.sub(r'__attribute__\(\(target\("[^"]*"\)\)\)', "", text))
    pool = (KERNELS / "pool.c").read_text()
    start = pool.index("shmk_split_plan shmk_split_units(")
    (tmp_path / "split.inc").write_text(pool[start : pool.index("/* ---- thread-local scratch")])
    exe = tmp_path / "a8_emulated"
    built = subprocess.run(
        ["gcc", "-O1", "-std=gnu11", f"-I{HERE}", f"-I{tmp_path}", "-o", str(exe),
         str(HERE / "a8_vnni_vs_portable.c"), "-lm"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    assert out.stdout.strip().endswith("768 runs, 0 differ")
