"""Shared-memory SPSC ring transport: typed duplex channels between processes.

Knows nothing about models or the engine.  See docs/ipc.md.
"""

from .channel import DEFAULT_CAPACITY, Channel, channel_pair
from .codec import Decoder, Encoder, detach
from .errors import (
    ChannelClosedError,
    IPCError,
    MalformedMessage,
    PeerDeadError,
    RingCorruptError,
)
from .handshake import ChannelListener, connect

__all__ = [
    "DEFAULT_CAPACITY",
    "Channel",
    "ChannelClosedError",
    "ChannelListener",
    "Decoder",
    "Encoder",
    "IPCError",
    "MalformedMessage",
    "PeerDeadError",
    "RingCorruptError",
    "channel_pair",
    "connect",
    "detach",
]
