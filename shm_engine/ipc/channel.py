"""Typed duplex channel over a pair of shared-memory SPSC rings (one per direction).

Threading: one thread may send while another receives (the two directions share no mutable
state); two threads must not send (or receive) on the same channel at once.

Blocking calls run inside one C call per wait slice (default 100 ms) with the GIL released; between
slices Python checks the peer's liveness socket, the local closed flag and the caller's timeout.
"""

from __future__ import annotations

import mmap
import select
import socket
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from .._ring_cffi import ffi, lib
from .codec import Buffer, Decoder, Encoder
from .errors import (
    ChannelClosedError,
    IPCError,
    MalformedMessage,
    PeerDeadError,
    RingCorruptError,
)

DEFAULT_CAPACITY = 4 << 20
DEFAULT_SPIN_US = 50.0
DEFAULT_SPIN_MIN_US = 2.0
DEFAULT_SLICE_MS = 100.0

HDR = lib.RING_HDR_SIZE
_M32 = 0xFFFFFFFF
_MSG_END = lib.RING_F_MSG_END << 32
_FRAME_END = lib.RING_F_FRAME_END << 32
_LARGE = lib.RING_F_LARGE << 32
_EAGAIN = lib.RING_EAGAIN
_SPIN = lib.RING_W_SPIN
_FRESH = lib.RING_W_FRESH  # the first attempt of a write call (the others resume its cursor)
_SPIN_FRESH = _SPIN | _FRESH
_ENOBUFS = -105
_write1 = lib.ring_write1
_read1 = lib.ring_read1
_readn = lib.ring_read
_readb = lib.ring_read_batch
_BATCH_SIMPLE = lib.RING_BATCH_SIMPLE
_POLL_MASK = select.POLLIN | select.POLLHUP | select.POLLERR
_CORRUPT_DETAIL = {
    1: "bad magic",
    2: "head counter out of range",
    3: "tail counter out of range",
    4: "record length out of bounds",
    5: "invalid record kind",
    6: "invalid wrap record",
    7: "message truncated",
}


def region_size(capacity: int) -> int:
    """Bytes of one ring (header + data area)."""
    return HDR + capacity


def check_capacity(capacity: int) -> None:
    if capacity < lib.RING_MIN_CAP or capacity & (capacity - 1) or capacity > 1 << 30:
        raise ValueError("capacity must be a power of two between 4 KiB and 1 GiB")


def init_segment(mm: mmap.mmap, capacity: int) -> None:
    """Format both rings of a freshly created two-ring segment."""
    buf = ffi.from_buffer(mm)
    try:
        size = region_size(capacity)
        base = ffi.cast("uint8_t *", buf)
        for off in (0, size):
            rc = lib.ring_region_init(base + off, size, capacity)
            if rc != 0:
                raise IPCError(f"ring_region_init failed ({rc})")
    finally:
        ffi.release(buf)


# A write: call(slice_ns, flags, nmsgs) -> rc, a closure over the arrays it keeps alive; the C
# write cursor resumes it after RING_EAGAIN.  ``nmsgs`` may be lower than the batch's length: a
# pending write stops after the fragmented message it left part published.
WriteCall = Callable[[int, int, int], int]


def _send_timeout(sent: int, nmsgs: int, mid: bool) -> TimeoutError:
    """TimeoutError whose ``sent`` counts the messages that are or will be delivered."""
    if mid:
        err = TimeoutError(
            f"send timed out inside a fragmented message ({sent} of {nmsgs} messages sent, "
            "the last in part: the next send or flush completes it)"
        )
        sent += 1
    else:
        err = TimeoutError(f"send timed out ({sent} of {nmsgs} messages sent)")
    err.sent = sent  # type: ignore[attr-defined]
    return err


class _Ring:
    """One direction: the private C state plus the Python-side liveness poller."""

    def __init__(self, base: Any, size: int, role: int, sock: socket.socket | None) -> None:
        err = ffi.new("int *")
        r = lib.ring_open(base, size, role, err)
        if r == ffi.NULL:
            if err[0] == lib.RING_ECORRUPT:
                raise RingCorruptError("ring header failed validation")
            raise IPCError(f"ring_open failed ({err[0]})")
        self.r = ffi.gc(r, lib.ring_free)
        self.poller = select.poll()
        if sock is not None:
            self.poller.register(sock.fileno(), _POLL_MASK)
        self.has_sock = sock is not None


class Channel:
    """Duplex message channel; create with ``ChannelListener.accept``/``connect`` or ``channel_pair``.

    ``send``/``recv`` move msgspec-encodable objects (numpy arrays and torch tensors as aux
    frames).  Received arrays are zero-copy views into the ring, valid until the next receive call
    on this channel (see ``shm_engine.ipc.codec``); pass ``zero_copy=False`` to get copies.
    """

    def __init__(
        self,
        mm: mmap.mmap,
        tx_offset: int,
        rx_offset: int,
        capacity: int,
        sock: socket.socket | None,
        recv_type: Any = Any,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        spin_min_us: float = DEFAULT_SPIN_MIN_US,
        slice_ms: float = DEFAULT_SLICE_MS,
        zero_copy: bool = True,
    ) -> None:
        check_capacity(capacity)
        size = region_size(capacity)
        if max(tx_offset, rx_offset) + size > len(mm):
            raise ValueError("ring regions exceed the mapping")
        self._mm = mm
        self._mv = memoryview(mm)
        self._buf = ffi.from_buffer(mm)  # keeps the mapping alive as long as the channel
        base = ffi.cast("uint8_t *", self._buf)
        self._sock = sock
        self._tx = _Ring(base + tx_offset, size, lib.RING_ROLE_PRODUCER, sock)
        self._rx = _Ring(base + rx_offset, size, lib.RING_ROLE_CONSUMER, sock)
        self._txr = self._tx.r
        self._rxr = self._rx.r
        for ring in (self._tx, self._rx):
            lib.ring_set_spin(ring.r, int(spin_min_us * 1000), int(spin_us * 1000))
        self.capacity = capacity
        self._rx_base = rx_offset
        self._slice_ns = max(1, int(slice_ms * 1e6))
        self._zero_copy = zero_copy
        self._enc = Encoder()
        self._dec = Decoder(recv_type)
        self._decode = self._dec.decode
        self._decode_body = self._dec._dec.decode  # single-frame fast path (no aux frames)
        self._encode_body = self._enc._enc.encode
        self._encode_into = self._enc._enc.encode_into
        self._closed = False
        self._peer_dead = False
        # NOTE: keep the instance under 30 attributes: one more (a 30th) cost ~1k instructions a
        # send + recv (callgrind), as CPython 3.11's attribute caches stop covering the instance.
        self._pending: tuple[WriteCall, int] | None = None  # a write to finish first, and its nmsgs
        self._partial: _Assembly | None = None  # a fragmented message being copied out
        self._out_n = 0
        self._grow_out(4096)
        # Reused argument arrays for single-message sends with aux frames.
        self._ptrs_n = 0
        self._grow_ptrs(16)

    # ---- helpers ------------------------------------------------------------------------

    def _grow_out(self, n: int) -> None:
        self._out_n = n
        self._out = ffi.new("uint64_t[]", 2 * n)
        self._outmv = memoryview(ffi.buffer(self._out)).cast("Q")

    def _grow_ptrs(self, n: int) -> None:
        self._ptrs_n = n
        self._ptrs = ffi.new("const char *[]", n)
        self._lens = ffi.new("uint64_t[]", n)
        self._nfr = ffi.new("uint32_t[1]")

    def _raise(self, rc: int, ring: _Ring) -> None:
        if rc == lib.RING_ECLOSED:
            if self._closed:
                raise ChannelClosedError("channel closed locally")
            raise ChannelClosedError("the peer closed the channel")
        if rc == lib.RING_ECORRUPT:
            detail = _CORRUPT_DETAIL.get(lib.ring_corrupt_detail(ring.r), "unknown")
            raise RingCorruptError(f"shared-memory ring is corrupt: {detail}")
        if rc == lib.RING_EBROKEN:
            raise IPCError(
                "the send side is unusable: a fragmented message was cut off by an error, and "
                "anything sent after it would be read as its rest"
            )
        raise IPCError(f"ring call failed ({rc})")

    def _check_alive(self, ring: _Ring) -> None:
        if self._closed:
            raise ChannelClosedError("channel closed locally")
        if self._peer_dead or (ring.has_sock and ring.poller.poll(0)):
            if self._closed:  # our own close() raced with the poll (fd closed under it)
                raise ChannelClosedError("channel closed locally")
            self._peer_dead = True
            raise PeerDeadError("peer process is gone (liveness socket hung up)")

    def peer_hung_up(self) -> bool:
        """Whether the peer's liveness socket has hung up (its process is gone); False for a
        channel without one. Reads only the socket: another thread may ask while this channel
        is otherwise unused (an engine loading its model watches its clients so)."""
        if self._sock is None or self._closed:
            return self._peer_dead
        poller = select.poll()  # NOTE: its own: a poll object must not be polled concurrently
        poller.register(self._sock.fileno(), _POLL_MASK)
        return self._peer_dead or bool(poller.poll(0))

    def _slice(self, timeout: float | None) -> int:
        if timeout is None:
            return self._slice_ns
        return min(self._slice_ns, max(0, int(timeout * 1e9)))

    # ---- sending ------------------------------------------------------------------------
    # NOTE: the C write cursor belongs to one write call at a time.  Whatever ends a write early
    # (an error, a timeout, or an exception a signal handler raises as the C call returns) goes
    # through _settle, which keeps the call pending if part of a fragmented message is already
    # published, or else resets the cursor: no later call resumes it with other arrays.  A
    # second signal can cut _settle itself short; the C side then refuses what would corrupt
    # the stream (see RING_W_FRESH in ring.h), so the worst case is a broken send side.

    def _settle(self, call: WriteCall, broken: bool) -> int:
        """Leave the cursor in a state the next send can trust; returns the messages sent."""
        mid = ffi.new("int *")
        sent = lib.ring_write_progress(self._txr, mid)
        if mid[0] and not broken:
            self._pending = (call, sent + 1)  # finish that message, nothing after it
        else:
            # After an error mid-message the consumer holds the head of a message whose rest
            # never comes: the C side then refuses every later write (RING_EBROKEN).
            lib.ring_write_abort(self._txr)
            self._pending = None
        return sent

    def _deadline_slice(self, deadline: float | None) -> int:
        if deadline is None:
            return self._slice_ns
        return min(self._slice_ns, max(0, int((deadline - time.monotonic()) * 1e9) + 1))

    def _drive(
        self,
        call: WriteCall,
        nmsgs: int,
        deadline: float | None,
        rc: int | None = None,
        fresh: bool = True,
    ) -> None:
        """Run a write to completion in wait slices, checking liveness and the deadline between.

        ``rc`` is the result of a first attempt a fast path already made; ``fresh`` is False
        when finishing a pending call.
        """
        flags = _SPIN_FRESH if fresh and rc is None else _SPIN
        settled = False
        try:
            while True:
                if rc is None:
                    rc = call(self._deadline_slice(deadline), flags, nmsgs)
                    flags = 0
                if rc == 0:
                    self._pending = None
                    return
                if rc != _EAGAIN:
                    settled = True
                    self._settle(call, broken=True)
                    self._raise(rc, self._tx)
                rc = None
                try:
                    self._check_alive(self._tx)
                except IPCError:
                    settled = True
                    self._settle(call, broken=True)
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    settled = True
                    sent = self._settle(call, broken=False)
                    raise _send_timeout(sent, nmsgs, self._pending is not None)
        except BaseException:
            if not settled:  # e.g. what a signal handler raised as the C call returned
                self._settle(call, broken=False)
            raise

    def _finish_pending(self, deadline: float | None) -> None:
        """Complete the fragmented message an earlier send left part written."""
        assert self._pending is not None
        call, nmsgs = self._pending
        try:
            self._drive(call, nmsgs, deadline, fresh=False)
        except TimeoutError:
            err = TimeoutError("send timed out finishing a fragmented message of an earlier send")
            err.sent = 0  # type: ignore[attr-defined]
            raise err from None

    def _write(
        self, call: WriteCall, nmsgs: int, timeout: float | None, rc: int | None = None
    ) -> None:
        """Run a write; ``rc`` is the result of a first attempt a fast path already made."""
        if rc is not None:
            if timeout is not None:  # that attempt may have waited up to one slice
                timeout = max(0.0, timeout - self._slice(timeout) / 1e9)
        elif self._closed:
            raise ChannelClosedError("channel closed locally")
        deadline = None if timeout is None else time.monotonic() + timeout
        if rc is None and self._pending is not None:
            self._finish_pending(deadline)
        self._drive(call, nmsgs, deadline, rc)

    def _write_frames(self, msgs: Sequence[Sequence[Buffer]], timeout: float | None) -> None:
        """General path: any number of messages of any number of frames."""
        nframes = [len(m) for m in msgs]
        total = sum(nframes)
        if any(n == 0 for n in nframes):
            raise ValueError("a message needs at least one frame")
        # NOTE: a pending write may still point into the reused arrays: then take fresh ones.
        if len(msgs) == 1 and total <= self._ptrs_n and self._pending is None:
            ptrs, lens, nfr = self._ptrs, self._lens, self._nfr
            nfr[0] = total
        else:
            ptrs = ffi.new("const char *[]", total)
            lens = ffi.new("uint64_t[]", total)
            nfr = ffi.new("uint32_t[]", nframes)
        keep = []
        i = 0
        for m in msgs:
            for f in m:
                cd = ffi.from_buffer(f)
                keep.append(cd)
                ptrs[i] = cd
                lens[i] = len(cd)
                i += 1
        tx = self._tx.r

        def call(slice_ns: int, flags: int, nmsgs: int) -> int:
            keep  # noqa: B018  (keeps the buffers alive while a pending write may resume)
            return lib.ring_write(tx, ffi.NULL, ptrs, lens, nfr, nmsgs, slice_ns, flags)

        self._write(call, len(msgs), timeout)

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Encode and send one message; blocks while the ring is full (backpressure)."""
        aux: list[Any] = []
        self._enc._aux = aux
        body = self._encode_body(obj)
        self._enc._aux = None  # the arrays must not outlive the send
        if aux:
            self._write_frames([[body, *aux]], timeout)
        else:
            self._send1(body, timeout)

    def _send1(self, body: bytes, timeout: float | None) -> None:
        tx = self._txr
        n = len(body)
        if self._pending is None:
            sl = self._slice_ns if timeout is None else self._slice(timeout)
            try:
                rc = _write1(tx, body, n, sl, _SPIN_FRESH)
                if rc == 0:
                    return
                self._write(lambda s, fl, nm: _write1(tx, body, n, s, fl), 1, timeout, rc)
            except BaseException:
                # NOTE: a signal handler's exception as the call returned, or on the way into
                # _drive (whose own bookkeeping settles what passes its `try`): unsettled, a
                # part-written message had left the next send a broken channel. Settling
                # again is harmless, unless it would drop the pending message a settle kept.
                if self._pending is None:
                    self._settle(lambda s, fl, nm: _write1(tx, body, n, s, fl), broken=False)
                raise
        else:
            self._write(lambda s, fl, nm: _write1(tx, body, n, s, fl), 1, timeout)

    def send_many(self, objs: Iterable[Any], timeout: float | None = None) -> None:
        """Send a batch with one C call (one head publish, at most one wake-up)."""
        objs = list(objs)
        if not objs:
            return
        enc = self._enc
        aux: list[Any] = []
        enc._aux = aux
        first = self._encode_body(objs[0])
        enc._aux = None
        if aux or len(first) > 4096:
            # Arrays or big bodies: one frame list per message, no concatenation copy.
            msgs = [[first, *aux]]
            for o in objs[1:]:
                msgs.append(enc.encode(o))
            self._write_frames(msgs, timeout)
            return
        buf = bytearray(first)
        lens = array("Q", [len(first)])
        into = self._encode_into
        enc._aux = aux
        for obj in objs[1:]:
            start = len(buf)
            into(obj, buf, -1)
            lens.append(len(buf) - start)
        enc._aux = None
        if aux:  # a later message carried arrays: redo the batch with frame lists
            self._write_frames([enc.encode(o) for o in objs], timeout)
            return
        self._write_blob(buf, lens, timeout)

    def _write_blob(self, buf: bytearray, lens: array, timeout: float | None) -> None:
        """Single-frame messages laid end to end in one buffer: no per-message cffi work."""
        cbuf = ffi.from_buffer(buf)
        clens = ffi.from_buffer("uint64_t[]", lens)
        tx = self._tx.r

        def call(slice_ns: int, flags: int, nmsgs: int) -> int:
            return lib.ring_write(tx, cbuf, ffi.NULL, clens, ffi.NULL, nmsgs, slice_ns, flags)

        self._write(call, len(lens), timeout)

    def has_pending_send(self) -> bool:
        """True when a timed-out send left a large message part written (see ``flush``)."""
        return self._pending is not None

    def flush(self, timeout: float | None = None) -> None:
        """Finish the message a timed-out send left part written; a no-op when there is none.

        The next send would do this first anyway; a producer with nothing more to send calls
        it so the consumer is not left waiting on the rest of a message.  Raises IPCError when
        an error cut such a message off (the send side is unusable).
        """
        if self._closed:
            raise ChannelClosedError("channel closed locally")
        if self._pending is not None:
            self._finish_pending(None if timeout is None else time.monotonic() + timeout)
        elif lib.ring_write_broken(self._txr):
            self._raise(lib.RING_EBROKEN, self._tx)

    def send_bytes(self, frames: Sequence[Buffer], timeout: float | None = None) -> None:
        """Send one message made of raw frames (no codec)."""
        if len(frames) == 1 and type(frames[0]) is bytes:
            self._send1(frames[0], timeout)
        else:
            self._write_frames([frames], timeout)

    # ---- receiving ----------------------------------------------------------------------

    @staticmethod
    def _deadline(timeout: float | None, waited_ns: int) -> float | None:
        """The deadline of a receive that has waited ``waited_ns`` already (a first C call's
        slice), so that ``timeout`` is a total for the call, however many reads it takes."""
        return None if timeout is None else time.monotonic() + timeout - waited_ns / 1e9

    def _read(self, max_msgs: int, deadline: float | None, n: int | None = None) -> int:
        """Return the number of entries in self._out, waiting in slices until ``deadline``;
        raises on errors.

        ``n`` is the result of a first C call a fast path already made (then <= 0).
        """
        rx = self._rx
        if n is None:
            n = _readn(rx.r, self._out, self._out_n, max_msgs, self._deadline_slice(deadline), 1)
            if n > 0:
                return n
        while True:
            if n > 0:
                return n
            if n == _ENOBUFS:
                self._grow_out(self._out_n * 4)
            elif n != _EAGAIN:
                self._raise(n, rx)
            else:
                try:
                    self._check_alive(rx)
                except PeerDeadError:
                    # Deliver what the peer sent before it died, then report the death.
                    n = lib.ring_read(rx.r, self._out, self._out_n, max_msgs, 0, 0)
                    if n > 0:
                        return n
                    if n == lib.RING_ECLOSED:
                        self._raise(n, rx)
                    raise
            slice_ns = self._slice_ns
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("recv timed out")
                slice_ns = min(slice_ns, int(left * 1e9) + 1)
            n = lib.ring_read(rx.r, self._out, self._out_n, max_msgs, slice_ns, 0)

    def _collect(self, n: int, deadline: float | None) -> list[list[Buffer]]:
        """Turn entries into frame lists; copies out a fragmented (large) message."""
        vals = self._outmv[: 2 * n].tolist()
        mv = self._mv
        base = self._rx_base
        if self._partial is not None or vals[1] & _LARGE:
            return [self._assemble(vals, deadline)]
        msgs: list[list[Buffer]] = []
        cur: list[Buffer] = []
        for i in range(0, 2 * n, 2):
            o = vals[i] + base
            lk = vals[i + 1]
            cur.append(mv[o : o + (lk & _M32)])
            if lk & _MSG_END:
                msgs.append(cur)
                cur = []
        return msgs

    def _assemble(self, vals: list[int], deadline: float | None) -> list[Buffer]:
        asm = self._partial
        if asm is None:
            asm = self._partial = _Assembly()
        mv = self._mv
        base = self._rx_base
        while True:
            # NOTE: the mark pairs the state before this batch with the ring position the batch
            # was read from; _interrupted rolls back to it only while the ring is still there
            # (no later read has released the batch).
            asm.mark = (len(asm.frames), len(asm.buf), lib.ring_consumed(self._rxr))
            done = False
            for i in range(0, len(vals), 2):
                o = vals[i] + base
                lk = vals[i + 1]
                asm.buf += mv[o : o + (lk & _M32)]
                if lk & _FRAME_END:
                    asm.frames.append(asm.buf)
                    asm.buf = bytearray()
                if lk & _MSG_END:
                    done = True
            if done:
                return asm.frames  # the caller clears _partial once it delivered them
            n = self._read(1, deadline)
            vals = self._outmv[: 2 * n].tolist()

    def _interrupted(self) -> None:
        """A receive ends with an exception: hand back what it read but did not deliver.

        A timeout, a dead peer, or an exception a signal handler raised (KeyboardInterrupt, the
        engine's SystemExit) as a read returned: the next receive gets the same entries again,
        and a fragmented message resumes from the last batch it fully copied.
        """
        tail = lib.ring_unread(self._rxr)
        asm = self._partial
        if asm is not None and asm.mark[2] == tail:
            nframes, nbytes, _ = asm.mark
            if len(asm.frames) > nframes:
                asm.buf = asm.frames[nframes]
                del asm.frames[nframes:]
            del asm.buf[nbytes:]

    # NOTE: whatever ends a receive before it returns (a timeout, a dead peer, an exception a
    # signal handler raised as a C read returned, be it KeyboardInterrupt, SystemExit or a
    # SIGALRM timer's TimeoutError) goes through _interrupted, so what the read took comes back
    # on the next receive.  Only a decode error consumes the message: it would fail again.

    def recv_bytes(self, timeout: float | None = None) -> list[Buffer]:
        """Receive one message as raw frames (views into the ring unless zero_copy=False)."""
        try:
            sl = self._slice_ns if timeout is None else self._slice(timeout)
            v = _read1(self._rxr, self._out, self._out_n, sl, 1)
            if v > _M32:  # one frame, packed as offset << 32 | length
                o = (v >> 32) + self._rx_base
                frames: list[Buffer] = [self._mv[o : o + (v & _M32)]]
            else:
                deadline = self._deadline(timeout, sl if v <= 0 else 0)
                n = v if v > 0 else self._read(1, deadline, v)
                frames = self._collect(n, deadline)[0]
            if not self._zero_copy:
                frames = [bytes(f) for f in frames]
        except BaseException:
            self._interrupted()
            raise
        self._partial = None
        return frames

    def recv(self, timeout: float | None = None) -> Any:
        """Receive and decode one message; TimeoutError, PeerDeadError, ChannelClosedError."""
        try:
            sl = self._slice_ns if timeout is None else self._slice(timeout)
            v = _read1(self._rxr, self._out, self._out_n, sl, 1)
            if v > _M32 and self._zero_copy:  # one frame, packed as offset << 32 | length
                o = (v >> 32) + self._rx_base
                return self._decode_body(self._mv[o : o + (v & _M32)])
            if v > _M32:
                o = (v >> 32) + self._rx_base
                frames: list[Buffer] = [bytearray(self._mv[o : o + (v & _M32)])]
            else:
                deadline = self._deadline(timeout, sl if v <= 0 else 0)
                n = v if v > 0 else self._read(1, deadline, v)
                frames = self._collect(n, deadline)[0]
                if not self._zero_copy:
                    frames = _copy([frames])[0]
            obj = self._decode(frames)
        except _DECODE_ERRORS as e:
            self._partial = None
            if isinstance(e, RecursionError):
                raise msgspec.DecodeError(f"message nested too deeply: {e}") from None
            raise
        except BaseException:
            self._interrupted()
            raise
        self._partial = None
        return obj

    def release(self) -> None:
        """Declare the views from the last receive dead, so the producer may reuse that space.

        Receive calls do this implicitly; call it when a thread holds on to its last batch while
        it does something else (e.g. sends on the same channel and waits for the peer).
        """
        lib.ring_release(self._rxr)

    def recv_all(self, timeout: float | None = None) -> list[Any]:
        """Receive every message already available (blocking only for the first one).

        A message that does not decode comes back as a ``MalformedMessage`` in its place, so it
        never costs the others of the batch (``recv`` raises the decode error instead).
        """
        try:
            sl = self._slice(timeout)
            n = _readb(self._rxr, self._out, self._out_n, self._rx_base, sl, 1)
            if n & _BATCH_SIMPLE and self._zero_copy and n > 0:
                # Common case: single-frame messages only, offsets already relative to the mapping.
                vals = self._outmv[: 2 * (n & ~_BATCH_SIMPLE)].tolist()
                dec = self._decode_body
                mv = self._mv
                bodies = [
                    mv[o : o + (lk & _M32)] for o, lk in zip(vals[::2], vals[1::2], strict=True)
                ]
                try:
                    return [dec(b) for b in bodies]
                except _DECODE_ERRORS:
                    # NOTE: the views are still valid (no receive since); decode one by one so a
                    # bad message costs only itself.
                    return [_decode_or_mark(dec, b) for b in bodies]
            deadline = self._deadline(timeout, sl if n <= 0 else 0)
            if n > 0:
                # The offsets were shifted by the region base; shift them back for _collect.
                n &= ~_BATCH_SIMPLE
                for i in range(0, 2 * n, 2):
                    self._out[i] -= self._rx_base
            else:
                n = self._read(0xFFFFFFFF, deadline, n)
            msgs = self._collect(n, deadline)
            if not self._zero_copy:
                msgs = _copy(msgs)
            out = [_decode_or_mark(self._decode, m) for m in msgs]
        except BaseException:
            self._interrupted()
            raise
        self._partial = None
        return out

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Idempotent.  The peer's recv drains what we sent, then raises ChannelClosedError.

        A fragmented message a timed-out send left part written (``has_pending_send``) is
        dropped, never delivered in part: ``flush`` first to deliver it.
        """
        if self._closed:
            return
        self._closed = True
        lib.ring_close(self._tx.r)
        lib.ring_close(self._rx.r)
        if self._sock is not None:
            self._sock.close()
        # The mapping itself is released by garbage collection, once no received view and no
        # thread still inside a ring call can touch it: unmapping here could crash either.

    def stats(self) -> dict[str, dict[str, int]]:
        """Wait/park/spin counters of both directions (for benchmarks and tuning)."""
        out = {}
        for name, ring in (("tx", self._tx), ("rx", self._rx)):
            v = ffi.new("uint64_t[5]")
            lib.ring_stats(ring.r, v, 5)
            out[name] = dict(
                zip(("waits", "parks", "spin_hits", "posts", "spin_ns"), v, strict=True)
            )
        return out

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# NOTE: RecursionError too: msgspec raises it for nesting past its limit (~1000 levels). Such a
# message would fail again on every receive, so like a malformed one it is consumed, never
# handed back to the ring (where it had blocked every message behind it).
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


class _Assembly:
    """A fragmented message being copied out of the ring, batch by batch."""

    __slots__ = ("frames", "buf", "mark")

    def __init__(self) -> None:
        self.frames: list[Buffer] = []
        self.buf = bytearray()
        # Before the latest batch: (frames, bytes of the open frame, ring_consumed at its read).
        self.mark = (0, 0, 0)


def _copy(msgs: list[list[Buffer]]) -> list[list[Buffer]]:
    """zero_copy=False: private writable copies (the ring space returns at the next receive)."""
    return [[bytearray(f) for f in m] for m in msgs]


def _decode_or_mark(decode: Callable[[Any], Any], data: Any) -> Any:
    """Decode one message of a batch; a malformed one becomes a MalformedMessage in its place."""
    try:
        return decode(data)
    except _DECODE_ERRORS as e:
        body = data if isinstance(data, (bytes, bytearray, memoryview)) else data[0]
        return MalformedMessage(str(e), bytes(body))


def channel_pair(
    capacity: int = DEFAULT_CAPACITY, recv_type_a: Any = Any, recv_type_b: Any = Any, **opts: Any
) -> tuple[Channel, Channel]:
    """Two connected channels in this process (anonymous shared memory, no names at all).

    For threads, tests and embedding; across processes use ChannelListener/connect.
    """
    check_capacity(capacity)
    size = region_size(capacity)
    mm = mmap.mmap(-1, 2 * size)
    init_segment(mm, capacity)
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = Channel(mm, 0, size, capacity, sa, recv_type_a, **opts)
    b = Channel(mm, size, 0, capacity, sb, recv_type_b, **opts)
    return a, b
