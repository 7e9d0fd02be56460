"""POSIX shared-memory segments whose name lives only between two system calls.

The creator opens the segment with O_EXCL and mode 0600 under an unguessable name and unlinks the
name at once; the peer gets the file descriptor over the handshake's Unix socket (SCM_RIGHTS),
never the name. The name carries the creator's pid, so the next create() unlinks a name whose
creator was SIGKILLed inside that window of microseconds: no exit of either process leaves
anything in /dev/shm past the next start.
"""

from __future__ import annotations

import contextlib
import errno
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
    _unlink_orphans()
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    # NOTE: the unlink's try encloses shm_open: a Python signal handler (Ctrl-C, the engine's
    # SIGTERM -> SystemExit) runs as soon as shm_open returns, and raising there stranded the
    # name. (Blocking signals would not do: another thread may take one for the main thread.)
    try:
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            os.fchmod(shm.fd, 0o600)  # independent of the umask
            if _created_hook is not None:
                _created_hook(name)
            _reserve(shm.fd, size)
        except BaseException:
            shm.close_fd()
            raise
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
    return shm.fd


def _reserve(fd: int, size: int) -> None:
    """Back every page of the segment now.

    NOTE: ftruncate on tmpfs reserves nothing and MAP_POPULATE skips pages it cannot back, so
    a full /dev/shm (Docker's default is 64 MiB) had surfaced as SIGBUS at the first touch of
    such a page, in the handshake or mid-stream; this is an OSError (ENOSPC) at creation.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise OSError(
            errno.ENOSPC, f"/dev/shm has no room for a {size / 2**20:.1f} MiB channel segment"
        ) from None


def _unlink_orphans(shm_dir: str = "/dev/shm") -> None:
    """Unlink names whose creator died between shm_open and unlink (SIGKILL, a window of µs).

    Only this user's names of pids that no longer exist; unlinking a live creator's name would
    be harmless anyway (its descriptor stays valid, its own unlink finds nothing).
    """
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return
    prefix = NAME_PREFIX.lstrip("/")
    for entry in entries:
        pid = entry[len(prefix) :].split("-", 1)[0] if entry.startswith(prefix) else ""
        if not pid.isdigit() or _pid_exists(int(pid)):
            continue
        with contextlib.suppress(OSError, posix_ipc.ExistentialError):
            if os.stat(os.path.join(shm_dir, entry)).st_uid == os.getuid():
                posix_ipc.unlink_shared_memory("/" + entry)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
