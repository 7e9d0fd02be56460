"""Channel tests with real processes: ordering, wake-ups, backpressure, crashes, hygiene."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import random
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm_engine.ipc import (
    ChannelClosedError,
    ChannelListener,
    MalformedMessage,
    PeerDeadError,
    channel_pair,
    connect,
    handshake,
    segment,
)

from . import children

CTX = mp.get_context("spawn")
CAP = 16384  # small ring: many wraps, and 4x capacity forces fragmentation


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shm_engine-")}


def _start(target: Any, *args: Any) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


@pytest.fixture
def created_names() -> Iterator[list[str]]:
    """Names of the segments created in this process, with their mode checked before unlink."""
    names: list[str] = []

    def hook(name: str) -> None:
        mode = stat.S_IMODE(os.stat("/dev/shm" + name).st_mode)
        assert mode == 0o600, oct(mode)
        names.append(name)

    segment.set_created_hook(hook)
    yield names
    segment.set_created_hook(None)
    for name in names:
        assert not os.path.exists("/dev/shm" + name), f"{name} left in /dev/shm"


@pytest.fixture(scope="module")
def echo_channel() -> Iterator[Any]:
    with ChannelListener() as lst:
        p = _start(children.echo, lst.address, {})
        ch = lst.accept(timeout=30, capacity=CAP)
        yield ch
        ch.close()
        p.join(10)
        assert p.exitcode == 0


_size = st.one_of(st.integers(0, 64), st.integers(0, 4096), st.integers(CAP // 2 - 64, 4 * CAP))
_message = st.tuples(st.lists(_size, min_size=1, max_size=4), st.integers(0, 2**32))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(_message, min_size=1, max_size=60), batched=st.booleans())
def test_random_sequences_echo_byte_for_byte(echo_channel: Any, msgs: list, batched: bool) -> None:
    """Random frame groups from 0 B to 4x capacity, sent while the echo flows back."""
    ch = echo_channel
    expected = [
        [children.payload(seed + i, n) for i, n in enumerate(sizes)] for sizes, seed in msgs
    ]
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            if batched:  # codec path: one frame per message, send_many batches
                flat = [b"".join(m) for m in expected]
                for i in range(0, len(flat), 7):
                    ch.send_many(flat[i : i + 7], timeout=30)
            else:
                for m in expected:
                    ch.send_bytes(m, timeout=30)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    t = threading.Thread(target=sender)
    t.start()
    try:
        if batched:
            got: list[Any] = []
            while len(got) < len(expected):
                got.extend(ch.recv_all(timeout=30))
            assert got == [b"".join(m) for m in expected]
        else:
            for m in expected:
                frames = ch.recv_bytes(timeout=30)
                assert [bytes(f) for f in frames] == m
    finally:
        t.join(60)
    assert not errors, errors


@pytest.mark.timeout(120)
def test_ping_pong_with_random_delays_loses_no_wakeup() -> None:
    """200k round trips, random delays on both sides, so both spin and park paths are hit.

    The wait slice is 5 s and the timeouts 5 s: a lost wake-up would surface as TimeoutError
    instead of being papered over by the periodic liveness re-check.
    """
    n = 200_000
    opts = {"slice_ms": 5000.0}
    rng = random.Random(1)
    with ChannelListener() as lst:
        p = _start(children.ping_pong, lst.address, n, 2, opts)
        ch = lst.accept(timeout=30, capacity=4096, **opts)
        for i in range(n):
            ch.send(i, timeout=5)
            children.random_delay(rng)
            assert ch.recv(timeout=5) == i
        stats = ch.stats()["rx"]
        ch.close()
        p.join(10)
    assert p.exitcode == 0
    assert stats["parks"] > 100 and stats["spin_hits"] > 1000, stats


def test_fast_producer_slow_consumer_backpressure() -> None:
    n = 3000
    with ChannelListener() as lst:
        p = _start(children.fast_producer, lst.address, n, {})
        ch = lst.accept(timeout=30, capacity=8192)
        for i in range(n):
            seq, data = ch.recv(timeout=10)
            assert seq == i and data == children.payload(i, i % 3000)
            children.busy_wait(100e-6)  # consumer ~10x slower than the producer
        tag, stats = ch.recv(timeout=10)
        assert tag == "stats"
        with pytest.raises(ChannelClosedError):
            ch.recv(timeout=10)
        ch.close()
        p.join(10)
    assert p.exitcode == 0
    assert stats["waits"] > 10, stats  # the producer really blocked on a full ring (spun or parked)


def _wait_dead(fn: Any, t_kill: float) -> float:
    with pytest.raises(PeerDeadError):
        while True:
            fn()
    return time.monotonic() - t_kill


def test_sigkill_producer_mid_stream(created_names: list[str]) -> None:
    """The creating side is killed while streaming fragmented messages to us."""
    before = _shm_names()
    parent, child_end = CTX.Pipe()
    p = _start(children.listener_producer, child_end, CAP)
    ch = connect(parent.recv(), timeout=30)
    assert parent.recv() == p.pid
    for _ in range(3):
        assert len(ch.recv_bytes(timeout=10)[0]) >= 3 * CAP
    os.kill(p.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    assert _wait_dead(lambda: ch.recv_bytes(timeout=10), t_kill) < 1.0
    p.join(10)
    assert _shm_names() <= before


def test_sigkill_consumer_while_producer_blocked(created_names: list[str]) -> None:
    before = _shm_names()
    with ChannelListener() as lst:
        p = _start(children.stalled_consumer, lst.address, 5, {})
        ch = lst.accept(timeout=30, capacity=CAP)
        assert len(created_names) == 1
        threading.Timer(0.5, os.kill, (p.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(PeerDeadError):
            while True:
                ch.send_bytes([b"x" * 3000], timeout=10)
        assert time.monotonic() - t0 < 1.5  # killed at 0.5 s, reported within 1 s
        p.join(10)
    assert _shm_names() <= before


def test_sigkill_idle_peer_while_blocked_in_recv(created_names: list[str]) -> None:
    with ChannelListener() as lst:
        p = _start(children.idle_peer, lst.address, {})
        ch = lst.accept(timeout=30, capacity=CAP)
        threading.Timer(0.3, os.kill, (p.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(PeerDeadError):
            ch.recv(timeout=10)
        assert time.monotonic() - t0 < 1.3
        p.join(10)


def test_a_signal_as_a_segment_is_created_leaves_no_name(
    created_names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A handler raising as shm_open returns (Ctrl-C, SIGTERM -> SystemExit) stranded the name.
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    def signalled_open(name: str, *args: Any, **kwargs: Any) -> posix_ipc.SharedMemory:
        real_open(name, *args, **kwargs).close_fd()
        created_names.append(name)
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before shm_open's caller does
        time.sleep(1)
        raise AssertionError("the signal handler did not run")

    real_open = posix_ipc.SharedMemory
    monkeypatch.setattr(segment.posix_ipc, "SharedMemory", signalled_open)
    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            segment.create(4096)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert len(created_names) == 1  # the fixture checks it is not in /dev/shm


def test_a_segment_dev_shm_cannot_hold_is_an_error_at_creation(created_names: list[str]) -> None:
    """tmpfs reserves nothing at ftruncate, so a segment larger than /dev/shm's free space had
    been a SIGBUS at the first touch of a page it could not back; now ENOSPC, leaving nothing."""
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="no room") as err:
        segment.create(1 << 50)  # past any tmpfs
    assert err.value.errno == errno.ENOSPC
    assert len(created_names) == 1 and len(os.listdir("/proc/self/fd")) == fds


def test_a_name_left_by_a_sigkilled_creator_is_unlinked_by_the_next() -> None:
    dead = CTX.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join(10)
    orphan = f"{segment.NAME_PREFIX}{dead.pid}-{'0' * 32}"
    alive = f"{segment.NAME_PREFIX}{os.getpid()}-{'1' * 32}"
    for name in (orphan, alive):
        posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    try:
        os.close(segment.create(4096))
        assert not os.path.exists("/dev/shm" + orphan)
        assert os.path.exists("/dev/shm" + alive)  # its creator may still be unlinking it
    finally:
        for name in (orphan, alive):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)


def test_segments_mode_0600_and_unlinked(created_names: list[str]) -> None:
    """The hook (see fixture) checks mode 0600 before unlink; several peers per listener."""
    with ChannelListener() as lst:
        procs = [_start(children.echo, lst.address, {}) for _ in range(2)]
        chans = [lst.accept(timeout=30, capacity=4096) for _ in procs]
        assert len(created_names) == 2
        for name in created_names:
            assert not os.path.exists("/dev/shm" + name)
        for i, ch in enumerate(chans):
            ch.send_bytes([b"hello %d" % i])
        for i, ch in enumerate(chans):
            assert bytes(ch.recv_bytes(timeout=10)[0]) == b"hello %d" % i
            ch.close()
        for p in procs:
            p.join(10)
            assert p.exitcode == 0


def test_peer_with_other_uid_is_dropped_and_the_listener_keeps_waiting() -> None:
    if os.getuid() != 0:
        pytest.fail("needs root to start a peer under another uid")
    with ChannelListener() as lst:
        p = _start(children.other_uid_connect, lst.address)
        with pytest.raises(TimeoutError):  # the foreign peer got no channel
            lst.accept(timeout=3)
        p.join(10)
        p = _start(children.other_uid_connect, lst.address)
        q = _start(children.echo, lst.address, {})
        ch = lst.accept(timeout=30)  # our own user's peer still gets through
        ch.send_bytes([b"hi"])
        assert bytes(ch.recv_bytes(timeout=10)[0]) == b"hi"
        ch.close()
        p.join(10)
        q.join(10)
        assert q.exitcode == 0


def test_accept_with_no_peer_times_out_even_at_zero() -> None:
    with ChannelListener() as lst:
        for timeout in (0, 0.05):  # 0 used to make the socket non-blocking: BlockingIOError
            with pytest.raises(TimeoutError):
                lst.accept(timeout=timeout)


def test_close_semantics_and_timeouts() -> None:
    a, b = channel_pair(4096)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        b.recv(timeout=0.1)
    assert 0.09 < time.monotonic() - t0 < 0.6
    a.send_many([1, 2, 3])
    a.close()
    a.close()  # idempotent
    assert b.recv_all(timeout=1) == [1, 2, 3]  # drained first
    with pytest.raises(ChannelClosedError):
        b.recv(timeout=1)
    with pytest.raises(ChannelClosedError):
        b.send(1)
    with pytest.raises(ChannelClosedError):
        a.recv(timeout=1)
    b.close()


def test_send_timeout_on_full_ring_sends_nothing_partial() -> None:
    a, b = channel_pair(4096)
    with pytest.raises(TimeoutError):
        while True:
            a.send_bytes([b"y" * 1000], timeout=0.05)
    got = []
    while True:
        try:
            got.append(bytes(b.recv_bytes(timeout=0)[0]))
        except TimeoutError:
            break
    assert got and all(g == b"y" * 1000 for g in got)
    a.send(b"after")  # the channel is still usable
    assert b.recv(timeout=1) == b"after"


def test_close_from_another_thread_wakes_blocked_calls() -> None:
    a, b = channel_pair(4096, slice_ms=5000.0)  # only the close itself can wake them early
    errors: list[BaseException] = []

    def blocked_recv() -> None:
        try:
            a.recv(timeout=10)
        except BaseException as e:
            errors.append(e)

    def blocked_send() -> None:
        try:
            while True:
                a.send_bytes([b"w" * 1000], timeout=10)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=blocked_recv), threading.Thread(target=blocked_send)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # both parked: a's inbox is empty, a -> b is full (b never reads)
    t0 = time.monotonic()
    a.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 1.0
    assert len(errors) == 2 and all(isinstance(e, ChannelClosedError) for e in errors), errors
    b.close()


def test_fragmented_send_timeout_is_completed_by_the_next_send() -> None:
    a, b = channel_pair(4096)
    big = children.payload(5, 3 * 4096)
    with pytest.raises(TimeoutError, match="next send or flush completes it"):
        a.send_bytes([big], timeout=0.05)  # nobody reads: stuck after the first fragments
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.extend(bytes(b.recv_bytes(timeout=5)[0]) for _ in "xy"))
    t.start()
    a.send_bytes([b"next"], timeout=5)  # first finishes the big one, then sends its own
    t.join(10)
    assert got == [big, b"next"]


class _Interrupt(BaseException):
    """What a signal handler (KeyboardInterrupt, the engine's SystemExit) raises mid-call."""


@pytest.fixture
def alarm() -> Iterator[Any]:
    """``alarm(seconds)``: raise _Interrupt in this (the main) thread after that long."""

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupt()

    old = signal.signal(signal.SIGALRM, handler)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _drain_frames(ch: Any, got: list) -> threading.Thread:
    """Read whole messages (as lists of bytes) into ``got`` until a receive times out."""

    def run() -> None:
        try:
            while True:
                got.append([bytes(f) for f in ch.recv_bytes(timeout=1)])
        except TimeoutError:
            pass

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_pending_fragmented_send_keeps_its_own_frames() -> None:
    # The pending write of a multi-frame message must not share the argument arrays the next
    # multi-frame send fills (it used to be finished with the new message's pointers).
    a, b = channel_pair(4096)
    old = [b"H" * 16, children.payload(1, 3 * 4096)]
    with pytest.raises(TimeoutError):
        a.send_bytes(old, timeout=0.05)
    got: list = []
    t = _drain_frames(b, got)
    new = [b"h" * 16, b"N" * 100]
    a.send_bytes(new, timeout=5)
    t.join(10)
    assert got == [old, new]


@pytest.mark.parametrize("kind", ["fragmented", "batch"])
def test_a_send_interrupted_by_a_signal_handler_corrupts_nothing(alarm: Any, kind: str) -> None:
    a, b = channel_pair(4096)
    if kind == "fragmented":
        first = [children.payload(2, 3 * 4096)]
        alarm(0.2)
        with pytest.raises(_Interrupt):
            a.send_bytes(first)  # blocks after the first fragments: nobody reads
        assert a.has_pending_send()  # the message is finished by the next send
    else:
        batch = [b"m%d" % i + b"." * 900 for i in range(10)]
        alarm(0.2)
        with pytest.raises(_Interrupt):
            a.send_many(batch)  # four fit, then it blocks
        assert not a.has_pending_send()  # the unsent tail is dropped, not resumed later
    got: list = []
    t = _drain_frames(b, got)
    nxt = b"NEXT" * 1200  # also fragmented (> capacity / 2)
    a.send_bytes([nxt], timeout=5)
    a.send_bytes([b"tail"], timeout=5)
    t.join(10)
    if kind == "fragmented":
        assert got == [first, [nxt], [b"tail"]]
    else:  # msgpack bin 16 bodies: 3 header bytes, then the payload
        assert [m[0][3:5] for m in got[:4]] == [b"m0", b"m1", b"m2", b"m3"]
        assert got[4:] == [[nxt], [b"tail"]]


def test_an_interrupt_on_the_way_into_the_write_loop_leaves_the_message_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler's exception after the first C call wrote part of a fragmented message,
    before the write loop's own bookkeeping (Python checks for signals as a function starts):
    the message stays pending as after a timeout (it had left the next send a broken side)."""
    a, b = channel_pair(4096)
    real = type(a)._write

    def interrupted(*args: Any, **kwargs: Any) -> None:
        monkeypatch.setattr(type(a), "_write", real)
        raise _Interrupt()

    monkeypatch.setattr(type(a), "_write", interrupted)
    big = children.payload(4, 3 * 4096)
    with pytest.raises(_Interrupt):
        a.send_bytes([big], timeout=0)
    assert a.has_pending_send()
    got: list = []
    t = _drain_frames(b, got)
    a.send_bytes([b"next"], timeout=5)
    t.join(10)
    assert got == [[big], [b"next"]]


def test_a_receive_interrupted_while_assembling_resumes_the_message(alarm: Any) -> None:
    a, b = channel_pair(4096)
    big = children.payload(3, 3 * 4096)
    with pytest.raises(TimeoutError):
        a.send_bytes([big], timeout=0.05)
    alarm(0.2)
    with pytest.raises(_Interrupt):
        b.recv_bytes()  # copies the first fragments, then waits for the rest
    sender = threading.Thread(target=lambda: (a.flush(timeout=5), a.send_bytes([b"next"])))
    sender.start()
    assert bytes(b.recv_bytes(timeout=5)[0]) == big  # not just its tail
    assert bytes(b.recv_bytes(timeout=5)[0]) == b"next"
    sender.join(5)


def test_send_many_timeout_counts_what_will_arrive() -> None:
    # A batch cut inside its fragmented first message: that message is completed by the next
    # send (so it counts as sent) and nothing after it is.
    a, b = channel_pair(4096)
    big = b"B" * (3 * 4096 - 1000)
    with pytest.raises(TimeoutError) as e:
        a.send_many([big, b"old1", b"old2"], timeout=0.05)
    assert e.value.sent == 1  # type: ignore[attr-defined]
    got: list = []
    t = threading.Thread(target=lambda: got.extend(b.recv(timeout=5) for _ in range(3)))
    t.start()
    a.send_many([b"new1", b"new2"], timeout=5)
    t.join(10)
    assert got == [big, b"new1", b"new2"]


def test_a_fragmented_send_cut_by_an_error_leaves_the_send_side_unusable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The consumer holds the head of a message whose rest never comes: any later message would
    # be spliced onto it, so every later send (not just the first) must refuse.
    from shm_engine.ipc.channel import Channel
    from shm_engine.ipc.errors import IPCError

    a, b = channel_pair(4096)
    real = Channel._check_alive

    def failing(self: Any, ring: Any) -> None:
        if self is a:
            raise IPCError("simulated liveness failure")
        real(self, ring)

    monkeypatch.setattr(Channel, "_check_alive", failing)
    with pytest.raises(IPCError, match="simulated"):
        a.send_bytes([children.payload(4, 3 * 4096)])  # blocks after the first fragments
    monkeypatch.setattr(Channel, "_check_alive", real)
    for _ in range(3):
        with pytest.raises(IPCError, match="unusable"):
            a.send_bytes([b"after"], timeout=1)
        assert not a.has_pending_send()  # nothing flush could finish
    with pytest.raises(IPCError, match="unusable"):
        a.flush(timeout=1)
    a.close()
    b.close()


class _InterruptOnReturn:
    """Wraps a C write: raises _Interrupt as the call returns ``rc`` (the first time only)."""

    def __init__(self, fn: Any, rc: int) -> None:
        self.fn, self.rc, self.fired = fn, rc, False

    def __call__(self, *args: Any) -> Any:
        rc = self.fn(*args)
        if rc == self.rc and not self.fired:
            self.fired = True
            raise _Interrupt()
        return rc


def _second_interrupt_in_settle(monkeypatch: pytest.MonkeyPatch, write_returns: int) -> None:
    """A first interrupt as a ring_write returns ``write_returns``, and a second one inside the
    channel's bookkeeping of it (Channel._settle), so the Python side records nothing."""
    from shm_engine.ipc import channel as channel_mod

    lib = channel_mod.lib
    write = _InterruptOnReturn(lib.ring_write, write_returns)

    def progress(*args: Any) -> Any:
        raise _Interrupt()

    proxy = _LibProxy(lib, ring_write=write, ring_write_progress=progress)
    monkeypatch.setattr(channel_mod, "lib", proxy)


def test_a_second_interrupt_cutting_the_bookkeeping_short_splices_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The channel lost track of a half-published fragmented message: the next fresh send must
    # not be written as its rest (the C side refuses it) and the consumer gets no message.
    from shm_engine.ipc import channel as channel_mod
    from shm_engine.ipc.errors import IPCError

    a, b = channel_pair(4096)
    _second_interrupt_in_settle(monkeypatch, channel_mod.lib.RING_EAGAIN)
    with pytest.raises(_Interrupt):
        a.send_bytes([b"head", children.payload(5, 3 * 4096)])  # nobody reads: EAGAIN
    monkeypatch.undo()
    assert not a.has_pending_send()  # the bookkeeping never happened
    got: list = []
    t = _drain_frames(b, got)
    for nxt in ([b"h", children.payload(6, 3 * 4096)], [b"short"]):
        with pytest.raises(IPCError, match="unusable"):
            a.send_bytes(nxt, timeout=1)
    t.join(10)
    assert got == []


def test_a_finished_write_whose_bookkeeping_was_cut_short_is_not_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    a, b = channel_pair(4096)
    big = [b"head", children.payload(7, 3 * 4096)]
    with pytest.raises(TimeoutError):
        a.send_bytes(big, timeout=0.05)
    assert a.has_pending_send()
    got: list = []
    t = _drain_frames(b, got)
    _second_interrupt_in_settle(monkeypatch, 0)
    with pytest.raises(_Interrupt):
        a.flush(timeout=5)  # the message is completed, then both interrupts hit
    monkeypatch.undo()
    assert a.has_pending_send()  # stale: its C cursor is already finished
    a.send_bytes([b"next"], timeout=5)  # resumes the stale call first: a no-op in C
    assert not a.has_pending_send()
    t.join(10)
    assert got == [big, [b"next"]]


def test_a_batch_whose_bookkeeping_was_cut_short_at_a_boundary_leaves_a_usable_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shm_engine.ipc import channel as channel_mod

    a, b = channel_pair(4096)
    batch = [b"m%d" % i + b"." * 900 for i in range(10)]
    _second_interrupt_in_settle(monkeypatch, channel_mod.lib.RING_EAGAIN)
    with pytest.raises(_Interrupt):
        a.send_many(batch)  # four fit, then it waits for room
    monkeypatch.undo()
    got: list = []
    t = _drain_frames(b, got)
    a.send_bytes([b"after"], timeout=5)  # a fresh call: drops the rest of the lost batch
    t.join(10)
    assert [m[0][3:5] for m in got[:4]] == [b"m0", b"m1", b"m2", b"m3"]
    assert got[4:] == [[b"after"]]


class _InterruptAfter:
    """Wraps a C read: the ``nth`` call that returns entries raises _Interrupt as it returns,
    as a signal handler would (its exception surfaces as soon as the C call is back)."""

    def __init__(self, fn: Any, nth: int) -> None:
        self.fn, self.nth, self.hits = fn, nth, 0

    def __call__(self, *args: Any) -> Any:
        rc = self.fn(*args)
        if rc > 0:
            self.hits += 1
            if self.hits == self.nth:
                raise _Interrupt()
        return rc


class _LibProxy:
    """The channel module's ``lib`` with some functions replaced."""

    def __init__(self, lib: Any, **replaced: Any) -> None:
        self._lib, self._replaced = lib, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced.get(name) or getattr(self._lib, name)


@pytest.mark.parametrize("method", ["recv", "recv_bytes", "recv_all"])
def test_messages_a_read_returned_as_an_interrupt_hit_come_back(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    from shm_engine.ipc import channel as channel_mod

    a, b = channel_pair(4096)
    a.send_many([b"one", b"two", b"three"])
    name = {"recv": "_read1", "recv_bytes": "_read1", "recv_all": "_readb"}[method]
    monkeypatch.setattr(channel_mod, name, _InterruptAfter(getattr(channel_mod, name), 1))
    with pytest.raises(_Interrupt):
        getattr(b, method)(timeout=1)
    got: list = []
    while len(got) < 3:
        r = getattr(b, method)(timeout=1)
        got += r if method == "recv_all" else [r]
    if method == "recv_bytes":
        got = [msgspec.msgpack.decode(g[0]) for g in got]
    assert got == [b"one", b"two", b"three"]


@pytest.mark.parametrize("nth", [1, 2, 3, 4])  # the message takes 6+ reads
@pytest.mark.parametrize("where", ["as a read returns", "before a read starts"])
def test_a_fragmented_message_interrupted_anywhere_arrives_whole(
    monkeypatch: pytest.MonkeyPatch, nth: int, where: str
) -> None:
    from shm_engine.ipc import channel as channel_mod
    from shm_engine.ipc.channel import Channel

    a, b = channel_pair(4096)
    big = [b"head", children.payload(nth, 5 * 4096), b"tail" * 300]
    sender = threading.Thread(target=lambda: (a.send_bytes(big), a.send_bytes([b"next"])))
    sender.start()
    time.sleep(0.05)  # the first fragments are in: the first read returns them
    if where == "as a read returns":
        reads = _InterruptAfter(channel_mod.lib.ring_read, nth - 1)  # the 1st is ring_read1
        first = _InterruptAfter(channel_mod._read1, 1 if nth == 1 else 0)
        monkeypatch.setattr(channel_mod, "_read1", first)
        monkeypatch.setattr(channel_mod, "_readn", reads)
        monkeypatch.setattr(channel_mod, "lib", _LibProxy(channel_mod.lib, ring_read=reads))
    else:  # the batch before was copied, but no read has given its ring space back yet
        real_read = Channel._read
        calls = iter(range(nth, 0, -1))

        def interrupted_read(self: Any, *args: Any) -> int:
            if next(calls) == 1:
                raise _Interrupt()
            return real_read(self, *args)

        monkeypatch.setattr(Channel, "_read", interrupted_read)
    with pytest.raises(_Interrupt):
        b.recv_bytes(timeout=5)
    monkeypatch.undo()
    assert [bytes(f) for f in b.recv_bytes(timeout=5)] == big
    assert bytes(b.recv_bytes(timeout=5)[0]) == b"next"
    sender.join(5)


def test_only_a_decode_error_consumes_the_message_being_decoded() -> None:
    a, b = channel_pair(4096)
    a.send_bytes([b"\xc1"])  # never valid msgpack
    a.send_many(["first", "second"])
    with pytest.raises(msgspec.DecodeError):
        b.recv(timeout=1)  # consumed: handing it back would fail the same way forever
    real = b._decode_body

    def alarm_fires(body: Any) -> Any:  # e.g. a SIGALRM timer's handler, while decoding
        b._decode_body = real
        raise TimeoutError("timer")

    b._decode_body = alarm_fires
    with pytest.raises(TimeoutError, match="timer"):
        b.recv(timeout=1)
    assert b.recv(timeout=1) == "first"
    assert b.recv(timeout=1) == "second"


def test_a_message_nested_too_deeply_is_consumed_not_handed_back() -> None:
    """msgspec raises RecursionError past ~1000 levels: a decode error like any other (it had
    been handed back to the ring, failing every receive after it)."""
    deep = b"\x91" * 5000 + b"\xc0"  # [[[...[nil]...]]]
    a, b = channel_pair(1 << 16)
    a.send_bytes([deep])
    a.send_many(["first", "second"])
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        b.recv(timeout=1)
    assert b.recv(timeout=1) == "first" and b.recv(timeout=1) == "second"
    for frames in ([deep], [deep + b"\x00" * 40_000]):  # in a batch; fragmented
        a.send_many(["before"])
        a.send_bytes(frames)  # (larger than half the ring: fragments)
        a.send_many(["after"])
        got = []
        while len(got) < 3:
            got += b.recv_all(timeout=1)
        assert got[0] == "before" and isinstance(got[1], MalformedMessage) and got[2] == "after"


def test_a_receive_timeout_is_a_total_for_a_trickled_fragmented_message() -> None:
    """A large message whose fragments come slowly: recv's timeout bounds the whole call, not
    each wait for the next fragment (0.5 s had taken 2.95 s)."""
    a, b = channel_pair(4096)
    stop = threading.Event()
    with pytest.raises(TimeoutError):
        a.send(b"x" * 40_000, timeout=0)  # the first fragments only: the ring is full

    def trickle() -> None:
        while not stop.is_set() and a.has_pending_send():
            with contextlib.suppress(TimeoutError):
                a.flush(timeout=0)
            time.sleep(0.2)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            b.recv(timeout=0.5)
        assert time.monotonic() - t0 < 1.0
    finally:
        stop.set()
        t.join()
    a.close()
    b.close()


def _peer_uid_check_as(uid: int) -> None:
    os.setuid(uid)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    assert handshake._check_peer_uid(a) == os.getpid()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to take another uid")
def test_a_user_with_a_uid_past_2_to_the_31_may_attach() -> None:
    # SO_PEERCRED's uid is unsigned: read as signed it never matched, so no handshake passed.
    p = mp.get_context("fork").Process(target=_peer_uid_check_as, args=(3_000_000_000,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
