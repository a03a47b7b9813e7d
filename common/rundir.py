"""The run folder: its lock (one job at a time: a second one would prune this one's checkpoints), the
check that it can take files, and the check that no one else could have written what a resume loads."""
import fcntl
import grp
import os
import pwd
import socket
import stat
import tempfile
import time
from pathlib import Path

from common.checkpoint import _NAME
from common.config import fail


HELD_LOCKS = []  # the run folder's lock, open for the life of the process (hold_run_dir)
# A node's preflight tests the lock, shared, for an instant (harness/launch.py's run_dir_in_use): rank 0, taking
# it then (a joining node's preflight as rank 0 restarts), retries for this long before it refuses the folder.
PREFLIGHT_S = 1.0


def hold_run_dir(run_dir, rank):
    """Make the run folder and its ckpt/; rank 0 holds its lock until it exits, or stops if it is in use."""
    (Path(run_dir) / "ckpt").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        lock = lock_run_dir(run_dir)
        if lock is None:
            fail(f"--run-dir {run_dir} is in use by another job (see its .lock); use another --run-dir")
        HELD_LOCKS.append(lock)


def lock_run_dir(run_dir, patience_s=PREFLIGHT_S):
    """The run folder's lock for this process's life, or None if held for `patience_s`; the OS drops a dead
    process's lock."""
    # Never through a link: opened so, a .lock linked to another file would be truncated below.
    f = os.fdopen(os.open(Path(run_dir) / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+")
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                return None
            time.sleep(0.01)  # a preflight's test ends within the millisecond; a job's lock lasts the job
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, job {os.environ.get('TORCHELASTIC_RUN_ID', '-')}\n")
    f.flush()
    return f


def writable(folder, create=True):
    """None if files can be created in `folder`, else why not. A missing one the job will make (`create`) is
    judged by the nearest one above it, so that a refused launch leaves no folder behind."""
    try:
        if create:
            folder = next(p for p in [Path(folder), *Path(folder).parents] if p.exists())
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def run_dir_problems(run_dir, export=""):
    """[the problem] if the run folder, its ckpt/ or --export's folder cannot take files, its .lock is not a
    plain file, or --export names a folder or one where another user could replace the file; else []."""
    lock = Path(run_dir) / ".lock"
    if lock.is_symlink() or (lock.exists() and not lock.is_file()):
        return [f"--run-dir: {lock} is not a plain file (a link or a folder): remove it"]
    if export and os.path.isdir(export):
        return [f"--export {export} is a folder: name the file to write"]
    folders = [("--run-dir", run_dir, True), ("--run-dir", os.path.join(run_dir, "ckpt"), True)]
    if export:
        folders.append(("--export", os.path.dirname(os.path.abspath(export)), False))
    for flag, folder, create in folders:
        why = writable(folder, create)
        if why:
            return [f"{flag}: {folder} is not a writable folder ({why})"]
    # Others must not replace the export: its folder is writable by no one else (as ckpt/), or sticky (/tmp).
    if export and (why := _written_by_others(folders[-1][1], True)):
        st = os.stat(folders[-1][1])
        if not (st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0)):
            return [f"--export: {why}: another user could replace the weights written there"]
    return []


def ownership_problems(run_dir, folders=()):
    """[one line] if another user could have written what a resume loads (it unpickles), else []. As ssh treats a
    key file, the run folder, ckpt/, each checkpoint and its files, and `folders`, must be this user's or root's,
    writable by no group but a private one and no others, and no checkpoint a link."""
    run_dir, ckpt_dir = Path(run_dir), Path(run_dir) / "ckpt"
    entries = [p for p in _listing(ckpt_dir) if _NAME.match(p.name)]
    inside = [f for p in entries if not p.is_symlink() for f in _listing(p)]
    # The run folder and ckpt/ are where the user pointed, through a link or not: their targets count.
    found = [why for path, follow in [(run_dir, True), (ckpt_dir, True), *((run_dir / f, False) for f in folders),
                                      *((p, False) for p in entries + inside)]
             if (why := _written_by_others(path, follow))]
    if not found:
        return []
    more = f" (and {len(found) - 1} more like it)" if len(found) > 1 else ""
    return [f"--run-dir: {found[0]}{more}; only what this user wrote is loaded or written into"]


def _listing(folder):
    """The entries of `folder`, sorted; [] if it is not a folder or is gone (a job running there prunes)."""
    try:
        return sorted(Path(folder).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _written_by_others(path, follow):
    """Why another user could have written `path` (see ownership_problems), or None; None if it is gone."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # run_dir_problems names a run folder that cannot be
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link: move it away, or put what it points to in its place"
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to {_user(st.st_uid)}, not to {_user(os.geteuid())} who runs this job"
    writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
               if st.st_mode & bit and not (who == "group" and _private_group(st.st_gid))]
    if writers:
        return (f"{path} is writable by {' and '.join(writers)} ({stat.filemode(st.st_mode)}): "
                f"chmod -R go-w {path}")
    return None


def _user(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _private_group(gid):
    """True if `gid` is this user's own group (its name, its primary group, no other member), as with umask
    002 on Debian: its write permission lets no one else in (Debian's ssh admits it)."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
