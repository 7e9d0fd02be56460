"""A scribbled ring must raise RingCorruptError, never crash: run in a throw-away process."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from . import children


@pytest.mark.timeout(180)
def test_scribbled_ring_raises_ring_corrupt_error() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=children.corruption_scenarios, args=(child,), daemon=True)
    p.start()
    assert parent.poll(150), "corruption scenarios did not finish (hang?)"
    results = parent.recv()
    p.join(10)
    assert p.exitcode == 0, f"child died with {p.exitcode} (a crash, e.g. SIGSEGV)"
    expected = {
        "magic": "bad magic",
        "poisoned": "bad magic",
        "head": "head counter",
        "reclen": "record length",
        "kind": "invalid record kind",
        "partial": "truncated",
        "wrap": "invalid wrap",
        "tail": "tail counter",
    }
    for key, text in expected.items():
        assert results[key].startswith("corrupt: ") and text in results[key], (key, results[key])
    assert "RingCorruptError" in results["fuzz"], results["fuzz"]
    print(results["fuzz"])
