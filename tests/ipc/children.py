"""Child-process bodies for the IPC tests (importable by multiprocessing's spawn start method)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from shm_engine.ipc import ChannelClosedError, ChannelListener, connect


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def random_delay(rng: random.Random) -> None:
    """Mostly nothing or a short busy wait (spin path), sometimes a sleep (forces a park)."""
    r = rng.random()
    if r < 0.6:
        return
    if r < 0.95:
        busy_wait(rng.uniform(0, 30e-6))
    else:
        time.sleep(rng.uniform(0, 300e-6))


def payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def echo(address: str, opts: dict[str, Any]) -> None:
    """Send every message back unchanged (raw frames) until the peer closes."""
    ch = connect(address, timeout=30, **opts)
    while True:
        try:
            frames = ch.recv_bytes()
        except ChannelClosedError:
            break
        ch.send_bytes(frames)
    ch.close()


def ping_pong(address: str, n: int, seed: int, opts: dict[str, Any]) -> None:
    ch = connect(address, timeout=30, **opts)
    rng = random.Random(seed)
    for i in range(n):
        got = ch.recv(timeout=5)
        if got != i:
            raise AssertionError(f"expected {i}, got {got}")
        random_delay(rng)
        ch.send(i, timeout=5)
    ch.close()


def fast_producer(address: str, n: int, opts: dict[str, Any]) -> None:
    """Send n messages as fast as possible (mixing send and send_many), then our stats."""
    ch = connect(address, timeout=30, **opts)
    i = 0
    while i < n:
        if i % 7 == 0:
            k = min(5, n - i)
            ch.send_many([(j, payload(j, j % 3000)) for j in range(i, i + k)])
            i += k
        else:
            ch.send((i, payload(i, i % 3000)))
            i += 1
    ch.send(("stats", ch.stats()["tx"]))
    ch.close()


def listener_producer(conn: Any, capacity: int) -> None:
    """Be the creating side; stream fragmented messages forever (killed by the test)."""
    with ChannelListener() as lst:
        conn.send(lst.address)
        ch = lst.accept(timeout=30, capacity=capacity)
        conn.send(os.getpid())
        i = 0
        while True:
            ch.send_bytes([payload(i, 3 * capacity + i % 100)])
            i += 1


def stalled_consumer(address: str, n_read: int, opts: dict[str, Any]) -> None:
    """Read n_read messages, then stop reading (the test kills us while the peer is blocked)."""
    ch = connect(address, timeout=30, **opts)
    for _ in range(n_read):
        ch.recv_bytes()
    time.sleep(60)


def idle_peer(address: str, opts: dict[str, Any]) -> None:
    connect(address, timeout=30, **opts)
    time.sleep(60)


def other_uid_connect(address: str) -> None:
    os.setgid(65534)
    os.setuid(65534)
    try:
        connect(address, timeout=5)
    except Exception:
        pass


def corruption_scenarios(conn: Any) -> None:
    """Scribble on a ring in this (throw-away) process; report which exception each raised."""
    import struct

    import msgspec

    from shm_engine.ipc import IPCError, RingCorruptError, channel_pair

    results: dict[str, str] = {}

    def pair() -> tuple[Any, Any, Any]:
        a, b = channel_pair(4096)
        return a, b, a._mm  # a -> b ring is region 0: magic@0 head@64 tail@128 data@512

    def outcome(fn: Any) -> str:
        try:
            fn()
        except RingCorruptError as e:
            return "corrupt: " + str(e)
        except Exception as e:
            return f"other: {type(e).__name__}: {e}"
        return "no error"

    a, b, mm = pair()
    a.send_bytes([b"x"])
    mm[0:8] = b"garbage!"
    results["magic"] = outcome(lambda: b.recv_bytes(timeout=1))
    results["poisoned"] = outcome(lambda: b.recv_bytes(timeout=1))

    a, b, mm = pair()
    a.send_bytes([b"x" * 10])
    struct.pack_into("<Q", mm, 64, 10**12)
    results["head"] = outcome(lambda: b.recv_bytes(timeout=1))

    a, b, mm = pair()
    a.send_bytes([b"abc"])
    struct.pack_into("<I", mm, 512, 0xFFFFFFF0)
    results["reclen"] = outcome(lambda: b.recv_bytes(timeout=1))

    a, b, mm = pair()
    a.send_bytes([b"abc"])
    struct.pack_into("<I", mm, 516, 0x77)
    results["kind"] = outcome(lambda: b.recv_bytes(timeout=1))

    a, b, mm = pair()
    a.send_bytes([b"abc", b"def"])  # two records, published together
    struct.pack_into("<Q", mm, 64, 16)  # head now covers only the first one
    results["partial"] = outcome(lambda: b.recv_bytes(timeout=1))

    a, b, mm = pair()
    for _ in range(2):  # two 1504-byte records (8 + 1496), consumed and released
        a.send_bytes([b"z" * 1496])
        b.recv_bytes(timeout=1)
        b.release()
    a.send_bytes([b"z" * 1496])  # 1088 bytes left at the end: a WRAP record at offset 3008
    struct.pack_into("<I", mm, 512 + 3008, 5)
    results["wrap"] = outcome(lambda: b.recv_bytes(timeout=1))

    a, b, mm = pair()
    struct.pack_into("<Q", mm, 128, 10**12)  # tail: read by the producer when it needs room

    def fill() -> None:
        for _ in range(10):
            a.send_bytes([b"q" * 1000], timeout=1)

    results["tail"] = outcome(fill)

    # Random scribbles anywhere in the header or data while messages are in flight: any outcome
    # but a crash (or a hang) is acceptable.
    rng = random.Random(1234)
    seen: dict[str, int] = {}
    for _ in range(3000):
        a, b, mm = pair()
        for _ in range(rng.randrange(1, 6)):
            try:
                a.send_bytes([payload(rng.randrange(99), rng.randrange(0, 1500))], timeout=0)
            except (TimeoutError, IPCError):
                break
        for _ in range(rng.randrange(1, 4)):
            off = rng.choice([rng.randrange(0, 384), rng.randrange(512, 512 + 4096)])
            mm[off : off + 4] = rng.randbytes(4)
        try:
            for _ in range(8):
                for f in b.recv_bytes(timeout=0):
                    bytes(f)
                b.recv_all(timeout=0)
            key = "ok"
        except TimeoutError:
            key = "timeout"
        except (IPCError, msgspec.DecodeError, msgspec.ValidationError) as e:
            key = type(e).__name__
        seen[key] = seen.get(key, 0) + 1
    results["fuzz"] = repr(sorted(seen.items()))
    conn.send(results)
