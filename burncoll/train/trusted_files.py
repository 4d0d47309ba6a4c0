"""Opening a file only from a place no other user can change, as OpenSSH's ``StrictModes``.

A checkpoint decides the parameters a run resumes with, so one planted by another local user
must never be loaded. :func:`check_trusted_directory` refuses a directory when it, or any
directory above it, is owned by someone other than this user or root, or is writable by group
or others (a sticky directory such as ``/tmp`` is fine: no one can rename or replace what
another user owns in it). :func:`open_trusted` then opens the file inside it without
following a symbolic link and without blocking (a FIFO or a device planted there is refused,
never waited on), and refuses it unless it is a regular file of this user or root that group
and others cannot write. Both raise :class:`~burncoll.UsageError` saying what is wrong and how
to fix it. Outside POSIX only the kind of file is checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from burncoll.errors import UsageError

__all__ = ["check_trusted_directory", "open_trusted"]

_POSIX = os.name == "posix"


def _untrusted(path: Path, info: os.stat_result, what: str) -> str | None:
    """Why ``path`` (of ``what`` kind) could have been changed by another user, or ``None``."""
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        return (f"{what} {str(path)!r} is owned by uid {info.st_uid}, neither this user "
                f"(uid {me}) nor root, so that user could have planted or changed the "
                f"checkpoint; if you trust it, make it yours: chown {me}")
    sticky_dir = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
    if info.st_mode & 0o022 and not sticky_dir:
        return (f"{what} {str(path)!r} is writable by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}), so they could have planted or replaced the "
                "checkpoint; if you trust it, restrict it: chmod go-w")
    return None


def check_trusted_directory(directory: Path) -> None:
    """Refuse ``directory`` unless only this user (or root) can change it and every directory
    above it (:class:`~burncoll.UsageError`). A missing one: those above it that exist (where
    it would be created), so that a run is refused before its first checkpoint, not when it
    resumes."""
    if not _POSIX:
        return
    real = directory.resolve()
    for place in (real, *real.parents):
        what = "checkpoint_dir" if place == real else "the directory above checkpoint_dir"
        try:
            info = os.stat(place)
        except FileNotFoundError:
            continue
        why = _untrusted(place, info, what)
        if why is not None:
            raise UsageError(f"{why} {str(place)!r}, or pass a checkpoint_dir that only you (or "
                             "root) can change (OpenSSH refuses its keys in such places for the "
                             "same reason)")


def open_trusted(directory: Path, name: str) -> int | None:
    """A read-only descriptor of the regular file ``directory/name``, checked; ``None`` when
    there is none. ``directory`` passes :func:`check_trusted_directory` first."""
    check_trusted_directory(directory)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    path = directory / name
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise UsageError(f"the checkpoint {str(path)!r} cannot be opened ({exc.strerror}); it "
                         "must be a regular file, not a symbolic link: remove it or pass "
                         "another checkpoint_dir") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UsageError(f"the checkpoint {str(path)!r} is not a regular file (a FIFO, device "
                         "or directory); remove it or pass another checkpoint_dir")
    why = _untrusted(path, info, "the checkpoint") if _POSIX else None
    if why is not None:
        os.close(fd)
        raise UsageError(f"{why} {str(path)!r}, or remove it (training then starts from step "
                         "0), or pass another checkpoint_dir")
    return fd
