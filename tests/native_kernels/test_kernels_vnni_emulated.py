"""The VNNI kernels (gemm16.c on W8 and W4 weights, gemm_a8.c, gemm_w4a8.c) on a CPU without
AVX-512: compiled against SIMDe's emulation of the intrinsics (emulated/), each must give its
portable twin's bits (quantiser and GEMM, ragged shapes, edge rows, 1 and 2 threads' splits,
bias, accumulation; 768-1280 cases each). Runs where the SIMDe headers
are installed (Debian: libsimde-dev); on VNNI CPUs the other kernel tests check the real
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


def _build_and_run(tmp_path, sources: tuple[str, ...], driver: str, edit=lambda t: t) -> str:
    """Compile ``driver`` (emulated/) with the kernel ``sources`` spliced in (``edit``ed) and
    run it."""
    for name in sources + ("vnni_tile.h", "common.h", "api.h"):
        text = (KERNELS / name).read_text()
        # NOTE: no target attributes: gcc would emit real AVX-512 for the emulation's code
        text = re.sub(r'__attribute__\(\(target\("[^"]*"\)\)\)', "", text)
        (tmp_path / name).write_text(edit(text) if name in sources else text)
    pool = (KERNELS / "pool.c").read_text()
    start = pool.index("shmk_split_plan shmk_split_units(")
    (tmp_path / "split.inc").write_text(pool[start : pool.index("/* ---- thread-local scratch")])
    exe = tmp_path / "emulated"
    built = subprocess.run(
        ["gcc", "-Og", "-std=gnu11", f"-I{HERE}", f"-I{tmp_path}", "-o", str(exe),
         str(HERE / driver), "-lm"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:]
    return out.stdout.strip()


def _portable_tiles_for(marker_start: str, marker_end: str, stub: str):
    """An edit that replaces a source's AVX2 GEMM (asm, which takes no emulated vector types;
    the CPU tests check it) by ``stub``, which runs the portable tiles."""

    def edit(text: str) -> str:
        return text[: text.index(marker_start)] + stub + text[text.index(marker_end) :]

    return edit


def test_a8_vnni_kernel_matches_portable_under_emulation(tmp_path):
    out = _build_and_run(tmp_path, ("gemm_a8.c",), "a8_vnni_vs_portable.c")
    assert out.endswith("768 runs, 0 differ")


def test_w4a8_vnni_kernel_matches_portable_under_emulation(tmp_path):
    """gemm_w4a8.c's VNNI kernel (vpdpbusd on the nibbles) gives the portable twin's bits:
    ragged shapes, 1-70 rows (slabs of 8 and their tails), edge rows, 1 and 2 threads' splits,
    bias, accumulation."""
    edit = _portable_tiles_for(
        "/* --- AVX2: slabs of up to 4 rows",
        "/* --- AVX512-VNNI:",
        "static void task_avx2(const w4a8_ctx *c, int64_t b0, int64_t b1, int64_t i0,"
        " int64_t i1) {\n    for (int64_t b = b0; b < b1; b++) tile_portable(c, b, i0, i1);\n}\n",
    )
    out = _build_and_run(tmp_path, ("gemm_w4a8.c",), "w4a8_vnni_vs_portable.c", edit)
    assert out.endswith("960 runs, 0 differ")


def test_gemm16_vnni_kernel_on_w8_and_w4_matches_portable_under_emulation(tmp_path):
    """gemm16.c's VNNI kernel, on W8 weights and on W4 nibbles (widened in the loop, minimums
    added after the groups), gives the portable tiles' bits, results and raw group dots."""
    edit = _portable_tiles_for(
        "/* --- AVX2: MR (<= 3) rows",
        "/* --- AVX512-VNNI: MR rows",
        "static void tile_avx2(const gemm_ctx *c, int64_t blk, int64_t i0, int64_t i1) {\n"
        "    tile_portable(c, blk, i0, i1);\n}\n\n",
    )
    out = _build_and_run(tmp_path, ("gemm16.c",), "gemm16_vnni_vs_portable.c", edit)
    assert out.splitlines()[-2:] == ["640 runs, 0 differ"] * 2  # W8, then W4
