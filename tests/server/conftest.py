"""Live-server helpers: start ``shm-engine serve`` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

DTYPE = os.environ.get("SHM_ENGINE_TEST_DTYPE", "int8")
MAX_MODEL_LEN = 512


def shm_entries() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if e.startswith("shm_engine")}


def leaked_shm(before: set[str]) -> set[str]:
    """Entries that appeared since ``before`` and persist (other users' segments are transient)."""
    new = shm_entries() - before
    if new:
        time.sleep(1.0)
        new &= shm_entries()
    return new


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """One ``shm-engine serve`` process; ``url`` is its base URL."""

    def __init__(self, log_path: Path, kv_cache_mib: int = 32, extra_args: tuple = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.shm_before = shm_entries()
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shm_engine.entrypoints.cli",
                "serve",
                "--port",
                str(self.port),
                "--kv-cache-mib",
                str(kv_cache_mib),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--max-num-seqs",
                "32",
                "--dtype",
                DTYPE,
                "--log-level",
                "warning",
                *extra_args,
            ],  # fmt: skip
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self._wait_healthy(timeout=120.0)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.output()}")

    def leaked_shm(self) -> set[str]:
        return leaked_shm(self.shm_before)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str) -> float:
        """Value of one unlabelled-by-us Prometheus sample, e.g. num_requests_running."""
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        for line in text.splitlines():
            if line.startswith("shm_engine_" + name + "{") or line.startswith(
                "shm_engine_" + name + " "
            ):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.kill()
        return rc

    def kill(self) -> None:
        """Last resort after a failed test: no process may outlive the module."""
        for p in getattr(self, "children", []):
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


@pytest.fixture
def make_server(tmp_path):
    """Factory for extra servers in one test; each is killed at the end if still running."""
    made: list[LiveServer] = []

    def make(**kw) -> LiveServer:
        made.append(LiveServer(tmp_path / f"server{len(made)}.log", **kw))
        return made[-1]

    yield make
    for srv in made:
        srv.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    srv = LiveServer(tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()
