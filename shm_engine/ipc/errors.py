"""Exceptions of the IPC layer.  Timeouts use the builtin ``TimeoutError``."""

from dataclasses import dataclass


class IPCError(Exception):
    """Base class of every transport failure, so callers can catch the whole family."""


class PeerDeadError(IPCError):
    """The process on the other end is gone (its liveness socket hung up)."""


class RingCorruptError(IPCError):
    """A bounds or format check on shared memory failed; the channel cannot be used any more."""


class ChannelClosedError(IPCError):
    """The channel was closed (by the peer after everything it sent was drained, or locally)."""


@dataclass(frozen=True)
class MalformedMessage:
    """Stands in ``Channel.recv_all``'s result for a message that failed to decode.

    ``body`` is a copy of its first frame, so the receiver can still tell whom to answer.
    """

    error: str
    body: bytes | None = None
