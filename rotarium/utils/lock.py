"""The lock a process holds on the folder it writes for its lifetime (a training run on its run folder, a prepare on
its OUT), so that two never write into one folder.

The lock is an OS file lock (``flock``) on ``<folder>/.lock``: the operating system releases it when the process ends
in any way, a SIGKILL or a crash included, so a dead process never leaves a lock that holds. The file also records
the holder (host, PID, start time) for the message a second one stops with; the holder deletes it when it lets go,
and a file left by a killed process is simply taken over. The recorded holder is the one that counts: the processes
it forks (DataLoader workers) inherit the locked descriptor and may outlive a SIGKILL by a few seconds, so a lock
whose recorded holder on this host is dead is stale even while they hold it, and is replaced. On a file system
without file locks (a Lustre or NFS mount without them) the file alone is the lock: it holds while its PID is alive
on this host (or, for another host, until someone deletes it), so a stale one is recognised by its PID and host.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from rotarium.utils.files import check_writable_folder, refuse_link

LOCK = ".lock"


class FolderLocked(ValueError):
    """Another process holds the folder's lock."""


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (it has not written its details yet)"
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


class FolderLock:
    """``FolderLock(folder)`` takes the lock at once or raises :class:`FolderLocked` naming the holder; ``release()``
    (or the process ending, however it ends) gives it back. Creates ``folder`` if needed, and removes it again on
    release if it made it and nothing else was written into it. ``flag`` names the folder in messages (the option
    that gave it), ``user`` what holds such a lock (``"run"``, ``"prepare"``)."""

    def __init__(self, folder: str | os.PathLike, flag: str = "--output-dir", user: str = "run"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.flag, self.user = flag, user
        self._fd: int | None = None
        check_writable_folder(self.folder, flag)
        self._made_dir = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd = self._acquire()
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(self.holder) + "\n").encode(), 0)
        os.fsync(self._fd)

    def _acquire(self) -> int:
        while True:
            try:  # the lock is written in place, so a link there would have it write into the link's target
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError:
                refuse_link(self.path, f"the {self.user} folder's lock")
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                if holder.get("host") == socket.gethostname() and not _alive(holder):
                    # the holder is dead, and only processes it forked hold the lock (DataLoader or pool workers,
                    # which inherited the descriptor and outlive it for a moment): that file goes, a new one is locked
                    _unlink_if_same(self.path, fd)
                    os.close(fd)
                    continue
                os.close(fd)
                raise FolderLocked(f"{self.flag} {self.folder} is in use by another {self.user}: {_describe(holder)}; "
                                   f"wait for it to end or choose another {self.flag} (the lock is {self.path}, "
                                   "released when that process exits)") from None
            except OSError:  # no file locks here: the holder's PID and host decide
                holder = _read_holder(fd)
                if holder and _alive(holder):
                    os.close(fd)
                    raise FolderLocked(f"{self.flag} {self.folder} is in use by another {self.user}: "
                                       f"{_describe(holder)}; this file system has no file locks, so if that "
                                       f"{self.user} has ended without releasing it, delete {self.path}") from None
                return fd
            # A holder deletes the file as it lets go: the file locked here must still be the one at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still locked, so no one locks a file about to disappear
        os.close(self._fd)
        self._fd = None
        if self._made_dir:
            try:
                self.folder.rmdir()  # only if empty: a process that stopped before writing anything leaves no folder
            except OSError:
                pass

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # the OS lock goes with the descriptor; the file stays and is taken over next time


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the process named by ``holder`` may still run: on this host, whether its PID exists; on another,
    which cannot be asked, yes."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True
    return True


def _unlink_if_same(path: Path, fd: int) -> None:
    """Deletes ``path`` when it is still the file open as ``fd`` (another process may have replaced it meanwhile)."""
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            path.unlink()
    except FileNotFoundError:
        pass


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}
