"""Connection set-up over an abstract-namespace Unix socket that then serves as the liveness link.

Listener (creates): HELLO <- ; SETUP(segment name, capacity) -> ; ATTACHED <- ; unlink ; READY ->.
The connector unlinks the name too, right after mapping it, so the name lives in /dev/shm only
for the few hundred microseconds of the handshake.  The connected socket then stays open inside
each Channel: a hang-up means the peer died (the kernel closes it on any exit, SIGKILL included).
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from typing import Any

import msgspec

from . import segment
from .channel import DEFAULT_CAPACITY, Channel, check_capacity, init_segment, region_size
from .errors import IPCError, PeerDeadError

PROTOCOL_VERSION = 1
_LEN = struct.Struct("<I")
_MAX_HANDSHAKE_MSG = 1 << 16


class _Hello(msgspec.Struct, tag="hello"):
    version: int
    pid: int


class _Setup(msgspec.Struct, tag="setup"):
    version: int
    shm: str
    capacity: int
    size: int


class _Attached(msgspec.Struct, tag="attached"):
    pass


class _Ready(msgspec.Struct, tag="ready"):
    pass


_HandshakeMsg = _Hello | _Setup | _Attached | _Ready
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_HandshakeMsg)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("handshake timed out")
    return left


def _send_msg(sock: socket.socket, msg: Any) -> None:
    data = _enc.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerDeadError("peer hung up during the handshake")
        buf += chunk
    return bytes(buf)


def _recv_msg(sock: socket.socket, expect: type, deadline: float | None) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > _MAX_HANDSHAKE_MSG:
        raise IPCError("handshake message too large")
    try:
        msg = _dec.decode(_recv_exact(sock, n, deadline))
    except msgspec.DecodeError as e:
        raise IPCError(f"malformed handshake message: {e}") from None
    if not isinstance(msg, expect):
        raise IPCError(f"handshake: expected {expect.__name__}, got {type(msg).__name__}")
    return msg


def _check_peer_uid(sock: socket.socket) -> int:
    """SO_PEERCRED: only a process of our own user may attach (abstract sockets have no mode)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise PermissionError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
    return pid


HANDSHAKE_TIMEOUT = 30.0  # seconds for the exchange after a peer connected


class ChannelListener:
    """Accepts peers on an unguessable abstract Unix socket; one Channel per accepted peer."""

    def __init__(self, backlog: int = 16) -> None:
        self._name = "shm_engine-" + secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self._name)  # abstract namespace: nothing on the filesystem
        self._sock.listen(backlog)

    @property
    def address(self) -> str:
        """Picklable address to hand to the peer process (for ``connect``)."""
        return self._name

    def accept(
        self,
        timeout: float | None = None,
        *,
        recv_type: Any = Any,
        capacity: int = DEFAULT_CAPACITY,
        **channel_opts: Any,
    ) -> Channel:
        """Wait for one peer, create the rings, hand them over, unlink their name, return the channel."""
        check_capacity(capacity)
        self._sock.settimeout(timeout)
        conn, _ = self._sock.accept()
        # NOTE: ``timeout`` bounds the wait for a peer; once one connected, the exchange gets its
        # own deadline, so a caller polling accept() in short slices never unlinks the segment
        # under a peer that is still attaching.
        deadline = _deadline(HANDSHAKE_TIMEOUT)
        try:
            _check_peer_uid(conn)
            _recv_msg(conn, _Hello, deadline)
            size = 2 * region_size(capacity)
            name, mm = segment.create(size)
            try:
                init_segment(mm, capacity)
                _send_msg(conn, _Setup(PROTOCOL_VERSION, name, capacity, size))
                _recv_msg(conn, _Attached, deadline)
            finally:
                segment.unlink(name)
            ch = Channel(mm, 0, region_size(capacity), capacity, conn, recv_type, **channel_opts)
            _send_msg(conn, _Ready())
            conn.settimeout(None)
            return ch
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ChannelListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str, timeout: float | None = None, *, recv_type: Any = Any, **channel_opts: Any
) -> Channel:
    """Attach to the listener at ``address``; returns once both sides mapped the rings."""
    deadline = _deadline(timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(_left(deadline))
        sock.connect("\0" + address)
        _check_peer_uid(sock)
        _send_msg(sock, _Hello(PROTOCOL_VERSION, os.getpid()))
        setup = _recv_msg(sock, _Setup, deadline)
        if setup.version != PROTOCOL_VERSION:
            raise IPCError(f"protocol version {setup.version} != {PROTOCOL_VERSION}")
        check_capacity(setup.capacity)
        if setup.size != 2 * region_size(setup.capacity):
            raise IPCError("segment size does not match the capacity")
        try:
            mm = segment.open_existing(setup.shm, setup.size)
        finally:
            segment.unlink(setup.shm)
        rsize = region_size(setup.capacity)
        ch = Channel(mm, rsize, 0, setup.capacity, sock, recv_type, **channel_opts)
        _send_msg(sock, _Attached())
        _recv_msg(sock, _Ready, deadline)
        sock.settimeout(None)
        return ch
    except BaseException:
        sock.close()
        raise
