"""Connection set-up over an abstract-namespace Unix socket that then serves as the liveness link.

Listener (creates): HELLO <- ; SETUP(capacity, size) + the segment's descriptor -> ; ATTACHED <- ;
READY ->.  The segment's name is unlinked as soon as it is created (segment.create), so nothing
is ever left in /dev/shm.  The connected socket then stays open inside each Channel: a hang-up
means the peer died (the kernel closes it on any exit, SIGKILL included).
"""

from __future__ import annotations

import array
import logging
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

PROTOCOL_VERSION = 2
_LEN = struct.Struct("<I")
_MAX_HANDSHAKE_MSG = 1 << 16
_FD_SIZE = array.array("i").itemsize

logger = logging.getLogger(__name__)


class _Hello(msgspec.Struct, tag="hello"):
    version: int
    pid: int


class _Setup(msgspec.Struct, tag="setup"):
    """Travels with the segment's file descriptor as SCM_RIGHTS ancillary data."""

    version: int
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


def _send_msg(sock: socket.socket, msg: Any, fd: int | None = None) -> None:
    body = _enc.encode(msg)
    data = _LEN.pack(len(body)) + body
    if fd is None:
        sock.sendall(data)
        return
    # The descriptor rides on the message's first bytes; a unix stream socket takes a message
    # this small in one sendmsg.
    if socket.send_fds(sock, [data], [fd]) != len(data):
        raise IPCError("handshake: short write of the setup message")


def _recv_exact(
    sock: socket.socket, n: int, deadline: float | None, fds: list[int] | None = None
) -> bytes:
    """Read n bytes; with ``fds``, also collect descriptors sent along (close-on-exec)."""
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_left(deadline))
        if fds is None:
            chunk = sock.recv(n - len(buf))
        else:
            chunk, anc, _flags, _addr = sock.recvmsg(
                n - len(buf), socket.CMSG_SPACE(_FD_SIZE), socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % _FD_SIZE
                    fds.extend(array.array("i", data[:usable]))
        if not chunk:
            raise PeerDeadError("peer hung up during the handshake")
        buf += chunk
    return bytes(buf)


def _recv_msg(
    sock: socket.socket, expect: type, deadline: float | None, fds: list[int] | None = None
) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, fds))
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
    # struct ucred: pid_t pid; uid_t uid; gid_t gid (ids unsigned: a uid past 2**31 is valid)
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, _gid = struct.unpack("iII", creds)
    if uid != os.getuid():
        raise PermissionError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
    return pid


def _accept_own_user(lsock: socket.socket, timeout: float | None) -> socket.socket:
    """Accept the next connection from a process of our user; others are dropped.

    Abstract socket names are visible in /proc/net/unix, so another user could connect: that
    must not abort the listener's wait for its real peer.
    """
    deadline = _deadline(timeout)
    while True:
        # NOTE: never settimeout(0): that makes the socket non-blocking, and accept() would
        # raise BlockingIOError instead of the TimeoutError callers expect at the deadline.
        lsock.settimeout(None if deadline is None else max(1e-6, deadline - time.monotonic()))
        conn, _ = lsock.accept()
        try:
            _check_peer_uid(conn)
            return conn
        except PermissionError as e:
            logger.warning("handshake: dropped a connection: %s", e)
            conn.close()


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
        conn = _accept_own_user(self._sock, timeout)
        # NOTE: ``timeout`` bounds the wait for a peer; once one connected, the exchange gets its
        # own deadline, so a caller polling accept() in short slices never unlinks the segment
        # under a peer that is still attaching.
        deadline = _deadline(HANDSHAKE_TIMEOUT)
        try:
            hello = _recv_msg(conn, _Hello, deadline)
            if hello.version != PROTOCOL_VERSION:
                raise IPCError(f"peer speaks protocol {hello.version}, not {PROTOCOL_VERSION}")
            size = 2 * region_size(capacity)
            fd = segment.create(size)
            try:
                mm = segment.map_fd(fd, size)
                init_segment(mm, capacity)
                _send_msg(conn, _Setup(PROTOCOL_VERSION, capacity, size), fd)
            finally:
                os.close(fd)
            _recv_msg(conn, _Attached, deadline)
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
        fds: list[int] = []
        try:
            setup = _recv_msg(sock, _Setup, deadline, fds)
            if setup.version != PROTOCOL_VERSION:
                raise IPCError(f"protocol version {setup.version} != {PROTOCOL_VERSION}")
            check_capacity(setup.capacity)
            if setup.size != 2 * region_size(setup.capacity):
                raise IPCError("segment size does not match the capacity")
            if len(fds) != 1:
                raise IPCError(f"handshake: expected one segment descriptor, got {len(fds)}")
            mm = segment.map_fd(fds[0], setup.size)
        finally:
            for fd in fds:
                os.close(fd)
        rsize = region_size(setup.capacity)
        ch = Channel(mm, rsize, 0, setup.capacity, sock, recv_type, **channel_opts)
        _send_msg(sock, _Attached())
        _recv_msg(sock, _Ready, deadline)
        sock.settimeout(None)
        return ch
    except BaseException:
        sock.close()
        raise
