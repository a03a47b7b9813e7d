"""The memory tier's files on a tmpfs (tiers/snapshot.py's, and the replicas' of tiers/replica.py): a
folder of this user's alone, files opened without following a link and checked to be this user's,
mapped into memory with their bytes reserved first, and the checksum that a slot's bytes are read back
with. A leaf: it imports nothing of the tiers, so both take these from here."""
import json
import mmap
import os
import stat
import zlib
from pathlib import Path

import torch


def private_folder(folder):
    """Make `folder` (mode 0700) unless it is there; then why it cannot hold this user's snapshots
    (folder_problem), or None."""
    try:
        Path(folder).parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return f"--snapshot-dir {folder}: cannot make it ({e.strerror})"
    return folder_problem(folder)


def folder_problem(folder):
    """Why the existing `folder` cannot hold this user's snapshots, or None. Another local user who made
    it, or who can write in it, could read them, plant files to be restored as this run's, or plant
    links that a write would follow; one who can write its parent (without the sticky bit that /dev/shm
    has) could swap it for another."""
    st, parent = os.lstat(folder), os.stat(Path(folder).parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return (f"--snapshot-dir {folder}: not a folder of this user's alone ({stat.filemode(st.st_mode)}, uid "
                f"{st.st_uid}; the tier needs mode 700), so its snapshots could be another's: remove it, or "
                "pass another")
    if parent.st_mode & 0o002 and not parent.st_mode & stat.S_ISVTX:
        return f"--snapshot-dir {folder}: anyone can write its parent (no sticky bit) and so replace it: pass another"
    return None


def open_checked(path, flags):
    """os.open(path) for the tier: never through a link, a file made with mode 600, checked to be a
    regular file of this user's that no one else can write (ValueError if not)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise ValueError(f"{Path(path).name} is not a file of this user's alone")
    return fd


def read_checked(path):
    with os.fdopen(open_checked(path, os.O_RDONLY), "rb") as f:
        return f.read()


def map_file(path, nbytes, write):
    """The file `path` as `nbytes` uint8 in memory. write: mapped shared (a write goes to the file), made if
    absent and its bytes reserved first: tmpfs answers a write to a page it cannot back with SIGBUS,
    which kills the process, where posix_fallocate raises OSError (ENOSPC). Else a private view of
    a file that must have that size (ValueError if not)."""
    fd = open_checked(path, os.O_RDWR | os.O_CREAT if write else os.O_RDONLY)
    try:
        if write:
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{Path(path).name} has the wrong size")
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED if write else mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def checksum(part, entries):
    """CRC32 of a part of a slot's bytes (uint8) and of the layout that gives them their meaning (names,
    dtypes, shapes, offsets): a record whose offsets were changed must not restore other weights."""
    return zlib.crc32(json.dumps(entries).encode(), zlib.crc32(part.numpy()))
