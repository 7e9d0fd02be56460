"""POSIX shared-memory segments whose name lives only between two system calls.

The creator opens the segment with O_EXCL and mode 0600 under an unguessable name and unlinks the
name at once; the peer gets the file descriptor over the handshake's Unix socket (SCM_RIGHTS),
never the name. So no exit of either process, SIGKILL included, can leave anything in /dev/shm.
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


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map a segment's descriptor read-write; its size must be the announced one."""
    if os.fstat(fd).st_size != size:
        raise ValueError("segment size does not match the announced size")
    # MAP_POPULATE: pre-fault the pages now, not on the first message's hot path.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def create(size: int) -> int:
    """Create a segment of ``size`` bytes and return its descriptor (the caller closes it).

    The name is unlinked before this returns; the descriptor is the only handle left.
    """
    name = NAME_PREFIX + secrets.token_hex(16)
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        os.fchmod(shm.fd, 0o600)  # independent of the umask
        if _created_hook is not None:
            _created_hook(name)
    except BaseException:
        shm.close_fd()
        raise
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
    return shm.fd
