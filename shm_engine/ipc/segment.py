"""Named POSIX shared-memory segments that live in /dev/shm only for the handshake.

Created with O_EXCL and mode 0600 under an unguessable name, mapped, and unlinked as soon as the
peer has mapped it, so nothing is left behind after any exit (SIGKILL included).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Callable

import posix_ipc

# Test hook: called with the segment name right after creation, before it is unlinked.
_created_hook: Callable[[str], None] | None = None

NAME_PREFIX = "/shm_engine-"


def set_created_hook(hook: Callable[[str], None] | None) -> None:
    """Install a callback run on every newly created segment name (tests check its mode)."""
    global _created_hook
    _created_hook = hook


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: pre-fault the pages now, not on the first message's hot path.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def create(size: int) -> tuple[str, mmap.mmap]:
    """Create and map a fresh segment; the caller must ``unlink`` the name once the peer mapped it."""
    name = NAME_PREFIX + secrets.token_hex(16)
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        os.fchmod(shm.fd, 0o600)  # independent of the umask
        mm = _map(shm.fd, size)
    except BaseException:
        unlink(name)
        raise
    finally:
        shm.close_fd()
    if _created_hook is not None:
        _created_hook(name)
    return name, mm


def open_existing(name: str, size: int) -> mmap.mmap:
    """Map a segment created by the peer; its size must match what the peer announced."""
    if not name.startswith(NAME_PREFIX) or "/" in name[1:]:
        raise ValueError(f"unexpected segment name {name!r}")
    shm = posix_ipc.SharedMemory(name)
    try:
        if os.fstat(shm.fd).st_size != size:
            raise ValueError("segment size does not match the announced size")
        return _map(shm.fd, size)
    finally:
        shm.close_fd()


def unlink(name: str) -> None:
    """Remove the name (both sides call it; the second call is a no-op)."""
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)
