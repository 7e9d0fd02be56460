"""IPC micro-benchmark: the shared-memory ring vs pyzmq ipc:// (PUSH/PULL) vs multiprocessing.Pipe.

    shm-engine bench ipc [--quick] [--json PATH]
    python -m shm_engine.benchmarks.ipc [--quick] [--json PATH]   (benchmarks/bench_ipc.py too)

Measured between two processes, side by side in one run:
- round trip p50/p99 of opaque byte payloads echoed back (transport, not codec);
- one-way throughput, the receiver decoding every message with msgspec (msgpack bin ->
  memoryview, msgspec's zero-copy decode, for every transport; batch API on the ring);
- the project's own messages end to end (encode + transport + decode, one way);
- a wake-up from the parked state next to a bare process-shared semaphore wake-up;
- the CPU the waiting side burns while idle for 5 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import msgspec
import numpy as np

from shm_engine.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from shm_engine.entrypoints.cli_parser import OneLineParser
from shm_engine.ipc import ChannelListener, Decoder, Encoder, connect
from shm_engine.sampling_params import SamplingParams

SIZES = [100, 2048, 65536, 1 << 20]

# ---- the engine's own messages (shm_engine/engine/protocol.py) --------------------------------

ProjectMsg = EngineCoreRequest | EngineCoreOutputs


def make_add_request() -> EngineCoreRequest:
    toks = np.random.default_rng(0).integers(0, 50000, 500, dtype=np.int32)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=256, seed=1234)
    return EngineCoreRequest(
        request_id="cmpl-3f9a1c2e7b4d4e0f-0", prompt_token_ids=toks, sampling_params=params
    )


def make_step_outputs() -> EngineCoreOutputs:
    """One decode step of 256 running requests: one new token each, one of them finishing."""
    return EngineCoreOutputs(
        request_ids=[f"cmpl-{i:016x}-0" for i in range(256)],
        num_new_tokens=[1] * 256,
        new_token_ids=list(range(1000, 1256)),
        finished={7: "stop"},
        scheduler_stats=SchedulerStats(num_running=256, kv_cache_usage=0.5, step_count=1000),
    )


# ---- child process ----------------------------------------------------------------------------


class _Zmq:
    def __init__(self, up: str, down: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(up)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(down)

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=10000)  # let the last (echoed) message leave before closing
        self.ctx.term()


def _child(ctrl: Any, data: Any) -> None:
    """Serve commands from the parent: each command is one benchmark phase."""
    import psutil  # noqa: F401  (import cost paid before any timing)

    while True:
        cmd = ctrl.recv()
        if cmd is None:
            return
        kind, transport, args = cmd
        ctrl.send(_PHASES[kind](transport, args, ctrl, data))


def _echo(transport: str, a: dict, ctrl: Any, data: Any) -> Any:
    n = a["n"]
    if transport == "ring":
        ch = connect(a["address"], timeout=10)
        ctrl.send("ready")
        for _ in range(n):
            ch.send_bytes(ch.recv_bytes())
        ch.close()  # the parent still drains what we sent
        return None
    if transport == "zmq":
        z = _Zmq(a["up"], a["down"])
        ctrl.send("ready")
        copy = a["size"] < 65536
        for _ in range(n):
            z.push.send(z.pull.recv(copy=copy), copy=copy)
        z.close()
        return None
    ctrl.send("ready")
    for _ in range(n):
        data.send_bytes(data.recv_bytes())
    return None


def _sink(transport: str, a: dict, ctrl: Any, data: Any) -> Any:
    """Receive and decode n messages; report when the last one is decoded."""
    n = a["n"]
    got = 0
    if transport == "ring":
        ch = connect(a["address"], timeout=10, recv_type=memoryview)
        ctrl.send("ready")
        while got < n:
            got += len(ch.recv_all())
        t = time.perf_counter()
        ch.close()
        return t
    dec = msgspec.msgpack.Decoder(memoryview)
    if transport == "zmq":
        z = _Zmq(a["up"], a["down"])
        ctrl.send("ready")
        copy = a["size"] < 65536
        for _ in range(n):
            m = z.pull.recv(copy=copy)
            dec.decode(m if copy else m.buffer)
        t = time.perf_counter()
        z.close()
        return t
    ctrl.send("ready")
    for _ in range(n):
        dec.decode(data.recv_bytes())
    return time.perf_counter()


def _project(transport: str, a: dict, ctrl: Any, data: Any) -> Any:
    """Decode project messages; one-way latency = decode done - encode start (CLOCK_MONOTONIC)."""
    n = a["n"]
    lat = []
    if transport == "ring":
        ch = connect(a["address"], timeout=10, recv_type=ProjectMsg)
        ctrl.send("ready")
        for _ in range(n):
            m = ch.recv()
            lat.append(time.perf_counter() - _sent_at(m))
            ch.send_bytes([b"k"])
        ch.close()
        return lat
    z = _Zmq(a["up"], a["down"])
    dec = Decoder(ProjectMsg)
    ctrl.send("ready")
    for _ in range(n):
        m = dec.decode(z.pull.recv_multipart())
        lat.append(time.perf_counter() - _sent_at(m))
        z.push.send(b"k")
    z.close()
    return lat


def _sent_at(m: Any) -> float:
    return m.arrival_time if isinstance(m, EngineCoreRequest) else m.timestamp


def _wake(transport: str, a: dict, ctrl: Any, data: Any) -> Any:
    """Parked wake-up: the parent sleeps long enough for us to park, then sends/posts."""
    n = a["n"]
    lat = []
    if transport == "ring":
        ch = connect(a["address"], timeout=10, recv_type=float)
        ctrl.send("ready")
        for _ in range(n):
            t0 = ch.recv()
            lat.append(time.perf_counter() - t0)
        stats = ch.stats()["rx"]
        ch.close()
        return lat, stats
    import posix_ipc

    from shm_engine._ring_cffi import ffi, lib

    shm = posix_ipc.SharedMemory(a["shm"])
    import mmap

    mm = mmap.mmap(shm.fd, 4096)
    shm.close_fd()
    buf = ffi.from_buffer(mm)
    p = ffi.cast("uint8_t *", buf)
    t0s = ffi.cast("double *", p + 64)
    ctrl.send("ready")
    for _ in range(n):
        rc = lib.ring_bench_sem_wait(p, 10_000_000_000)
        t = time.perf_counter()
        assert rc == 0
        lat.append(t - t0s[0])
    ffi.release(buf)
    return lat, {}


def _idle(transport: str, a: dict, ctrl: Any, data: Any) -> Any:
    ch = connect(a["address"], timeout=10)
    ctrl.send("ready")
    ch.recv()  # blocks (parked) until the parent wakes us after its measurement
    s = ch.stats()["rx"]
    ch.close()
    return s


_PHASES = {"echo": _echo, "sink": _sink, "project": _project, "wake": _wake, "idle": _idle}


# ---- parent -----------------------------------------------------------------------------------


class Bench:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        ctx = mp.get_context("spawn")
        self.ctrl, child_ctrl = ctx.Pipe()
        self.data, child_data = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_ctrl, child_data), daemon=True)
        self.proc.start()
        self.listener = ChannelListener()
        self.tmp = tempfile.mkdtemp(prefix="bench_ipc_")
        self.rows: list[dict] = []
        self.extra: list[dict] = []

    def close(self) -> None:
        self.ctrl.send(None)
        self.proc.join(10)
        self.listener.close()
        for f in os.listdir(self.tmp):
            os.unlink(os.path.join(self.tmp, f))
        os.rmdir(self.tmp)

    def _start(self, kind: str, transport: str, args: dict) -> Any:
        """Start a phase in the child; returns the parent's end of the transport."""
        args = dict(args)
        if transport == "ring":
            args["address"] = self.listener.address
            self.ctrl.send((kind, transport, args))
            end = self.listener.accept(timeout=10)
        elif transport == "zmq":
            import zmq

            ctx = zmq.Context()
            up, down = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            tag = f"{kind}-{len(self.rows)}-{len(self.extra)}"
            args["up"] = f"ipc://{self.tmp}/{tag}-up"
            args["down"] = f"ipc://{self.tmp}/{tag}-down"
            up.bind(args["up"])
            down.bind(args["down"])
            self.ctrl.send((kind, transport, args))
            end = (ctx, up, down)
        else:
            self.ctrl.send((kind, transport, args))
            end = self.data
        assert self.ctrl.recv() == "ready"
        return end

    @staticmethod
    def _end_zmq(end: Any) -> None:
        ctx, up, down = end
        up.close(linger=1000)
        down.close(linger=0)
        ctx.term()

    def rtt(self, transport: str, size: int, n: int) -> tuple[float, float]:
        payload = os.urandom(size)
        end = self._start("echo", transport, {"n": n, "size": size})
        times = []
        pc = time.perf_counter
        if transport == "ring":
            for _ in range(n):
                t = pc()
                end.send_bytes([payload])
                r = end.recv_bytes()
                times.append(pc() - t)
            assert bytes(r[0]) == payload
            end.close()
        elif transport == "zmq":
            _, up, down = end
            copy = size < 65536
            for _ in range(n):
                t = pc()
                up.send(payload, copy=copy)
                down.recv(copy=copy)
                times.append(pc() - t)
            self._end_zmq(end)
        else:
            for _ in range(n):
                t = pc()
                end.send_bytes(payload)
                end.recv_bytes()
                times.append(pc() - t)
        self.ctrl.recv()
        times = sorted(times[n // 10 :])
        return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6

    def throughput(self, transport: str, size: int, n: int) -> float:
        payload = os.urandom(size)
        enc = msgspec.msgpack.Encoder()
        end = self._start("sink", transport, {"n": n, "size": size})
        t0 = time.perf_counter()
        if transport == "ring":
            batch = max(1, min(256, (256 << 10) // size))
            sent = 0
            while sent < n:
                k = min(batch, n - sent)
                if k == 1:
                    end.send(payload)
                else:
                    end.send_many([payload] * k)
                sent += k
        elif transport == "zmq":
            _, up, _ = end
            copy = size < 65536
            for _ in range(n):
                up.send(enc.encode(payload), copy=copy)
        else:
            for _ in range(n):
                end.send_bytes(enc.encode(payload))
        t1 = self.ctrl.recv()
        if transport == "zmq":
            self._end_zmq(end)
        elif transport == "ring":
            end.close()
        return n / (t1 - t0)

    def project(self, transport: str, name: str, msg: Any, n: int) -> dict:
        enc = Encoder()
        end = self._start("project", transport, {"n": n})
        pc = time.perf_counter
        for _ in range(n):
            if isinstance(msg, EngineCoreRequest):
                msg.arrival_time = pc()
            else:
                msg.timestamp = pc()
            if transport == "ring":
                end.send(msg)
                end.recv_bytes()
            else:
                _, up, down = end
                up.send_multipart(enc.encode(msg), copy=True)
                down.recv()
        if transport == "ring":
            end.close()
        else:
            self._end_zmq(end)
        lat = sorted(self.ctrl.recv()[n // 10 :])
        size = sum(len(f) for f in enc.encode(msg))
        return {
            "transport": f"{transport}/{name}",
            "size_bytes": size,
            "oneway_p50_us": lat[len(lat) // 2] * 1e6,
            "oneway_p99_us": lat[int(len(lat) * 0.99)] * 1e6,
        }

    def wake(self, n: int, gap: float) -> tuple[dict, dict]:
        end = self._start("wake", "ring", {"n": n})
        for _ in range(n):
            time.sleep(gap)
            end.send(time.perf_counter())
        end.close()
        ring_lat, stats = self.ctrl.recv()
        import mmap
        import secrets

        import posix_ipc

        from shm_engine._ring_cffi import ffi, lib

        name = "/shm_engine-bench-" + secrets.token_hex(8)
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=4096)
        mm = mmap.mmap(shm.fd, 4096)
        shm.close_fd()
        buf = ffi.from_buffer(mm)
        p = ffi.cast("uint8_t *", buf)
        lib.ring_bench_sem_init(p)
        t0s = ffi.cast("double *", p + 64)
        self.ctrl.send(("wake", "sem", {"n": n, "shm": name}))
        assert self.ctrl.recv() == "ready"
        shm.unlink()
        for _ in range(n):
            time.sleep(gap)
            t0s[0] = time.perf_counter()
            lib.ring_bench_sem_post(p)
        sem_lat, _ = self.ctrl.recv()
        ffi.release(buf)
        mm.close()

        def summary(lat: list[float]) -> dict:
            lat = sorted(lat[n // 10 :])
            return {"p50_us": lat[len(lat) // 2] * 1e6, "p90_us": lat[int(len(lat) * 0.9)] * 1e6}

        r = summary(ring_lat) | {"parks": stats["parks"], "waits": stats["waits"]}
        return r, summary(sem_lat)

    def idle(self, seconds: float) -> tuple[float, dict]:
        import psutil

        end = self._start("idle", "ring", {})
        proc = psutil.Process(self.proc.pid)
        time.sleep(0.2)  # let the spin budget run out and the waiter park
        c0 = proc.cpu_times()
        t0 = time.perf_counter()
        time.sleep(seconds)
        c1 = proc.cpu_times()
        t1 = time.perf_counter()
        end.send(None)
        stats = self.ctrl.recv()
        end.close()
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        return 100.0 * cpu / (t1 - t0), stats


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(
        prog="shm-engine bench ipc",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="short run (fewer iterations)")
    ap.add_argument("--json", metavar="PATH", help="write one object per (transport, size)")
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    q = 10 if args.quick else 1
    b = Bench(args.quick)
    transports = ["ring", "zmq", "pipe"]
    rtt_n = {100: 20000, 2048: 20000, 65536: 5000, 1 << 20: 600}
    tput_n = {100: 400000, 2048: 200000, 65536: 20000, 1 << 20: 2000}
    slow = {"ring": 1, "zmq": 4, "pipe": 4}
    try:
        for size in SIZES:
            for tr in transports:
                p50, p99 = b.rtt(tr, size, max(50, rtt_n[size] // q // slow[tr]))
                mps = b.throughput(tr, size, max(20, tput_n[size] // q // slow[tr]))
                row = {
                    "transport": tr,
                    "size_bytes": size,
                    "rtt_p50_us": round(p50, 2),
                    "rtt_p99_us": round(p99, 2),
                    "msgs_per_s": round(mps),
                    "mb_per_s": round(mps * size / 1e6, 1),
                }
                b.rows.append(row)
                print(
                    f"  {tr:5s} {size:>8d} B  rtt p50 {p50:8.1f} us  p99 {p99:8.1f} us"
                    f"  {mps:12,.0f} msg/s  {mps * size / 1e6:9,.1f} MB/s",
                    flush=True,
                )
        msgs = [
            ("add_request_500", make_add_request()),
            ("step_outputs_256", make_step_outputs()),
        ]
        for name, msg in msgs:
            for tr in ("ring", "zmq"):
                r = b.project(tr, name, msg, max(200, 5000 // q))
                b.extra.append(r)
                print(
                    f"  {r['transport']:40s} one way p50 {r['oneway_p50_us']:7.1f} us", flush=True
                )
        ring_wake, sem_wake = b.wake(max(50, 300 // q), 0.002)
        idle_pct, idle_stats = b.idle(args.idle_seconds)
    finally:
        b.close()

    by = {(r["transport"], r["size_bytes"]): r for r in b.rows}
    print("\nRound trip (opaque bytes echoed), us          one-way throughput with msgspec decode")
    print(
        f"{'size':>8s} {'transport':9s} {'p50':>8s} {'p99':>8s} {'p50 ratio':>10s}"
        f" {'msgs/s':>12s} {'MB/s':>9s} {'tput ratio':>10s}"
    )
    for size in SIZES:
        ring = by[("ring", size)]
        for tr in transports:
            r = by[(tr, size)]
            ratio = r["rtt_p50_us"] / ring["rtt_p50_us"]
            tratio = ring["msgs_per_s"] / r["msgs_per_s"]
            print(
                f"{size:>8d} {tr:9s} {r['rtt_p50_us']:8.1f} {r['rtt_p99_us']:8.1f} {ratio:9.1f}x"
                f" {r['msgs_per_s']:12,d} {r['mb_per_s']:9,.1f} {tratio:9.1f}x"
            )
    print("\nProject messages, encode + transport + decode, one way (us)")
    for r in b.extra:
        print(
            f"  {r['transport']:40s} {r['size_bytes']:>7d} B  p50 {r['oneway_p50_us']:7.1f}"
            f"  p99 {r['oneway_p99_us']:7.1f}"
        )
    print(
        f"\nWake-up from parked: ring p50 {ring_wake['p50_us']:.1f} us (p90 {ring_wake['p90_us']:.1f},"
        f" parked {ring_wake['parks']} times in {ring_wake['waits']} waits)  bare semaphore p50"
        f" {sem_wake['p50_us']:.1f} us (p90 {sem_wake['p90_us']:.1f})  ratio"
        f" {ring_wake['p50_us'] / sem_wake['p50_us']:.2f}x"
    )
    print(
        f"Idle waiting side: {idle_pct:.3f}% of a core over {args.idle_seconds:.0f} s"
        f" (waits {idle_stats['waits']}, parks {idle_stats['parks']})"
    )
    if args.json:
        out = list(b.rows)
        for r in b.extra:
            out.append(
                {
                    "transport": r["transport"],
                    "size_bytes": r["size_bytes"],
                    "rtt_p50_us": None,
                    "rtt_p99_us": None,
                    "msgs_per_s": None,
                    "mb_per_s": None,
                    "oneway_p50_us": round(r["oneway_p50_us"], 2),
                    "oneway_p99_us": round(r["oneway_p99_us"], 2),
                }
            )
        out.append(
            {
                "transport": "ring/wakeup_from_parked",
                "size_bytes": 0,
                "rtt_p50_us": None,
                "rtt_p99_us": None,
                "msgs_per_s": None,
                "mb_per_s": None,
                "wake_p50_us": round(ring_wake["p50_us"], 2),
                "bare_sem_wake_p50_us": round(sem_wake["p50_us"], 2),
                "idle_cpu_percent": round(idle_pct, 4),
            }
        )
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
