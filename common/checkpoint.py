"""Checkpoint mechanics shared by the scripts: atomic write, committed-checkpoint lookup,
keep-last-K, moving unreadable checkpoints aside, the run folder (its lock, the check that it is
writable, and the check that no one else could have written its checkpoints), the settings check on
resume, RNG capture, the parameter digest, and the disk interval by Young and Daly's rule.

What a checkpoint contains, its format version, and how it is restored stay in each script.

Layout: <run-dir>/ckpt/step-NNNNNNNN.pt (one file, committed by its atomic rename) or
<run-dir>/ckpt/step-NNNNNNNN/ (a DCP folder, committed once its `.metadata` exists, which DCP
writes last). Anything else in ckpt/ (temp files, uncommitted folders, checkpoints moved aside
as `step-NNNNNNNN*.unreadable-<time>`) is never loaded.
"""
import dataclasses
import fcntl
import grp
import hashlib
import json
import math
import os
import pwd
import random
import re
import shutil
import socket
import stat
import statistics
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from common.config import fail
from common.dist import PREEMPTED, agree, print0, restarts, set_collective_timeout

_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")
COMMIT_MARKER = ".metadata"  # DCP's own metadata file, written after every rank's shards


def step_name(step, suffix=""):
    return f"step-{step:08d}{suffix}"


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _WriteErrors:
    """A file for `write` that remembers the OSError of a failed write, which torch.save reports only
    as a RuntimeError about a position."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def atomic_write(path, write, before_commit=None, mode=0o666):
    """Write a file through `write(f)` to a temp file in the same folder, fsync, rename, fsync the folder.

    A crash at any point leaves either the old state or the complete new file, never a partial
    `path`. `before_commit` runs when the bytes are on disk but not yet committed (fault injection).
    The temp file is made afresh (a link in its place is removed, not followed), with `mode` (less the
    umask). Returns the number of bytes written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a crashed process's, whose pid this one reuses
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode), "wb") as f:
            out = _WriteErrors(f)
            try:
                write(out)
            except Exception as e:
                raise out.error or e  # the disk's own error (ENOSPC), not torch.save's "unexpected pos"
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk must not collect one temp file per attempt
        tmp.unlink(missing_ok=True)
        raise
    if before_commit:
        before_commit()
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path.stat().st_size


def atomic_save(obj, path, before_commit=None):
    """torch.save, committed atomically (see atomic_write)."""
    return atomic_write(path, lambda f: torch.save(obj, f), before_commit)


def cpu_copy(obj, pin, memo=None):
    """A copy of `obj` (dicts, lists and tuples of tensors and plain values) whose tensors own CPU memory,
    pinned if `pin` (the copies from the GPU are then non-blocking: synchronize before reading them). A
    tensor met twice (tied weights) is copied once, as torch.save would store it once."""
    memo = {} if memo is None else memo
    if torch.is_tensor(obj):
        if id(obj) not in memo:
            memo[id(obj)] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin).copy_(obj.detach(), non_blocking=pin)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return {k: cpu_copy(v, pin, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v, pin, memo) for v in obj)
    return obj


def atomic_write_json(obj, path):
    return atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def is_committed(path):
    path = Path(path)
    return path.is_file() if path.suffix == ".pt" else (path / COMMIT_MARKER).is_file()


def checkpoints(ckpt_dir, committed=True):
    """[(step, path)] newest first: the committed checkpoints, or (committed=False) the uncommitted folders."""
    found = []
    if Path(ckpt_dir).is_dir():
        for p in Path(ckpt_dir).iterdir():
            m = _NAME.match(p.name)
            if m and is_committed(p) == committed:
                found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


UNDELETABLE = set()  # the checkpoints remove() could not delete, said once each


def remove(path):
    """Delete a checkpoint file or folder, first renamed to a name the lookup ignores, so that no part
    of it is ever found as a checkpoint. One that cannot be renamed (permissions) is kept, with one line:
    cleaning up is no reason to stop training. Returns whether it is gone."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.removing-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return True
    except OSError as e:
        if path not in UNDELETABLE:
            UNDELETABLE.add(path)
            print(f"could not delete {path} ({e.strerror}): it is kept; delete it yourself", flush=True)
        return False
    shutil.rmtree(doomed, ignore_errors=True) if doomed.is_dir() else doomed.unlink(missing_ok=True)
    return True


def prune(ckpt_dir, keep, committed_step, held=()):
    """After the commit of `committed_step`: keep it and the `keep - 1` committed checkpoints before
    it, delete older ones but the steps `held` (not yet archived: tiers/archive.py), and drop
    uncommitted folders older than it (left by a crash; a newer one may still be being written by an
    async save). Checkpoints newer than the one just committed are never counted or deleted here. Call
    on one rank only."""
    older = [(step, path) for step, path in checkpoints(ckpt_dir) if step < committed_step]
    for step, path in older[max(keep - 1, 0):]:
        if step not in held:
            remove(path)
    for step, path in checkpoints(ckpt_dir, committed=False):
        if step < committed_step:
            remove(path)
    for tmp in Path(ckpt_dir).glob(".step-*.tmp-*"):  # temp files of saves that died before their rename
        tmp.unlink(missing_ok=True)


def move_aside(path, why):
    """Rename a committed checkpoint that did not load to a name the lookup ignores, so that a later
    save never lands in a folder that looks committed and a person can still recover its bytes.
    Call on one rank only. Returns the new path."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(path, aside)
    fsync_dir(path.parent)
    print(f"moved {path.name} aside to {aside.name} ({why}); it is kept for inspection, never loaded", flush=True)
    return aside


HELD_LOCKS = []  # the run folder's lock, open for the life of the process (hold_run_dir)


def hold_run_dir(run_dir, rank):
    """Make the run folder and its ckpt/; rank 0 then holds the folder's lock until it exits (a second job
    would prune this one's checkpoints), and a folder in use stops the job in one line."""
    (Path(run_dir) / "ckpt").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        lock = lock_run_dir(run_dir)
        if lock is None:
            fail(f"--run-dir {run_dir} is in use by another job (see its .lock); use another --run-dir")
        HELD_LOCKS.append(lock)


def lock_run_dir(run_dir):
    """Hold an exclusive lock on the run folder for the life of this process, or return None if
    another job holds it. The OS drops a dead process's lock, so a crash never leaves it stale."""
    # Never through a link: opened so, a .lock linked to another file would be truncated below.
    f = os.fdopen(os.open(Path(run_dir) / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, job {os.environ.get('TORCHELASTIC_RUN_ID', '-')}\n")
    f.flush()
    return f


def run_dir_in_use(run_dir, job=None):
    """Why a new job must not start in `run_dir` (a running job holds its lock), or None. Checked once,
    before the workers start (harness/launch.py): a worker would see its own rank 0's lock. `job`: the
    rendezvous id of a node joining a job of several nodes, which passes if it is the holder's."""
    if not (Path(run_dir) / ".lock").exists():
        return None
    lock = lock_run_dir(run_dir)
    if lock is not None:
        lock.close()
        return None
    holder = (Path(run_dir) / ".lock").read_text().strip() or "another process"
    if job is not None and holder.rpartition(", job ")[2] == job:  # a node of the running job: it joins it
        return None
    return (f"--run-dir {run_dir} is in use by another job ({holder} holds its .lock): "
            "wait for it to end, or use another --run-dir")


def writable(folder, create=True):
    """None if files can be created in `folder`, else why not. A missing folder that the job will make
    (`create`) is judged by the nearest one above it: checking makes nothing, so that a refused launch
    leaves no folder behind."""
    try:
        if create:
            folder = next(p for p in [Path(folder), *Path(folder).parents] if p.exists())
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def run_dir_problems(run_dir, export=""):
    """['--run-dir: ... is not a writable folder (why)'] if the run folder, its ckpt/ or the folder of
    the file --export names cannot take files, or its .lock is not a plain file, or --export names a
    folder; else []."""
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
    return []


def ownership_problems(run_dir):
    """['--run-dir: ...'] (one line, the first problem and how many more) if another user could have
    written what a resume loads, else []. Loading a checkpoint unpickles it, so, as ssh treats a key
    file, the run folder, its ckpt/, each checkpoint there (step-NNNNNNNN.pt, step-NNNNNNNN/) and each
    file of a checkpoint folder must belong to this user (or root) and not be writable by group or
    others; a checkpoint is never a symbolic link. A user private group (see _private_group) may write.
    What does not exist yet (a fresh run) is fine."""
    run_dir, ckpt_dir = Path(run_dir), Path(run_dir) / "ckpt"
    entries = [p for p in _listing(ckpt_dir) if _NAME.match(p.name)]
    inside = [f for p in entries if not p.is_symlink() for f in _listing(p)]
    # The run folder and ckpt/ are where the user pointed, through a link or not: their targets count.
    found = [why for path, follow in [(run_dir, True), (ckpt_dir, True), *((p, False) for p in entries + inside)]
             if (why := _written_by_others(path, follow))]
    if not found:
        return []
    more = f" (and {len(found) - 1} more like it)" if len(found) > 1 else ""
    return [f"--run-dir: {found[0]}{more}; only checkpoints this user wrote are loaded"]


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
    """True if `gid` is this user's own group (named after the user, its primary group, no other member),
    as with umask 002 on Debian and Ubuntu: its write permission lets no one else in (Debian's ssh
    admits it so)."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def refuse_unfit(saved, cfg, path, fmt, shape_fields, sample_fields):
    """resume_problem of the checkpoint `path` (its record `saved`): a problem stops the job in one line
    (exit 2); the settings that changed, where --allow-changes lets them, are printed."""
    problem, changes = resume_problem(saved, cfg, fmt, shape_fields, sample_fields, cfg.allow_changes)
    if problem:
        fail(f"{path}: {problem}")
    if changes:
        print0(f"resuming with changed settings: {', '.join(changes)}")


def keeping_settings(optimizer, load):
    """load(), which loads a saved state into `optimizer`, and its result; the param groups keep this
    run's settings (weight decay, betas, eps, fused; the lr is set at each step), not the saving run's
    that the state brings: a changed flag applies on a resume from disk as it does from memory."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    result = load()
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)
    return result


def restore_rng(rngs, saved_world, seed, step, rank, world):
    """This rank's RNG as saved (`rngs`: every rank's, of a job of `saved_world` ranks), or, at another
    world size, where each rank's stream cannot carry over, derived anew from the seed and the step.
    Returns whether the world size changed."""
    if saved_world == world:
        set_rng_state(rngs[rank])
        return False
    seed_rng(seed + step, rank)
    return True


def resume_problem(saved, cfg, fmt, shape_fields, sample_fields, allow_changes=False):
    """Check a checkpoint's saved record (its `format` and `config`) against this run's config and
    the format `fmt` that this script writes and reads.

    Returns (problem, changes): `problem` is a one-line reason to refuse the resume, or None;
    `changes` lists the settings that differ ("lr 0.003 -> 0.01"). A change of `shape_fields` (the
    model's weights would not fit) is always refused; a change of `sample_fields` (which samples a
    step sees: seed, batch, data) unless `allow_changes`."""
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        return "not a checkpoint of these scripts (no config in it); use another --run-dir", []
    if saved.get("format") != fmt:
        return f"checkpoint format {saved.get('format')}, this script reads format {fmt}; use another --run-dir", []
    old, new = saved["config"], dataclasses.asdict(cfg)
    foreign = sorted(set(old) - set(new))  # settings this script does not have: another script wrote it
    if foreign and not allow_changes:
        return (f"checkpoint was written by another script (or version): its settings include "
                f"{', '.join(foreign[:4])}, which this one does not have; use another --run-dir"), []
    changed = [k for k in new if k != "run_dir" and k in old and old[k] != new[k]]
    changes = [f"{k} {old[k]} -> {new[k]}" for k in changed]
    shape = [k for k in changed if k in shape_fields]
    if shape:
        made_with = ", ".join(f"{k}={old[k]} (this run: {new[k]})" for k in shape)
        return f"checkpoint was made with {made_with}; use another --run-dir", changes
    samples = [k for k in changed if k in sample_fields]
    if samples and not allow_changes:
        made_with = ", ".join(f"{k}={old[k]} (this run: {new[k]})" for k in samples)
        return (f"checkpoint was made with {made_with}, so the resumed job would train on other samples: "
                "use another --run-dir, or --allow-changes if you mean it"), changes
    return None, changes


def newest_resume_problem(ckpt_dir, cfg, read_saved, fmt, shape_fields, sample_fields):
    """The resume problem (see resume_problem) with the newest readable checkpoint, or None.
    `read_saved(path)` returns a checkpoint's saved record; unreadable ones are skipped (the resume
    falls back past them)."""
    for _, path in checkpoints(ckpt_dir):
        locked = next((f for f in [path, *(path.rglob("*") if path.is_dir() else [])]
                       if not os.access(f, os.R_OK | (os.X_OK if f.is_dir() else 0))), None)
        if locked:  # not damage: the resume would take it for damaged and move it aside
            return f"{locked}: cannot read it (permission denied): fix its permissions, nothing was moved"
        try:
            saved = read_saved(path)
        except (IsADirectoryError, NotADirectoryError):  # a folder where this script writes a file, or the reverse
            return (f"{path}: another script's checkpoint (a {'folder: fsdp' if path.is_dir() else 'file: ddp or rpc'}"
                    "'s): use another --run-dir")
        except Exception:
            continue
        problem, _ = resume_problem(saved, cfg, fmt, shape_fields, sample_fields, cfg.allow_changes)
        return problem and f"{path}: {problem}"
    if getattr(cfg, "archive", ""):  # no checkpoint here: the resume would fetch the archive's newest
        from tiers.archive import newest_archived
        where, config = newest_archived(cfg.archive)
        problem = where and resume_problem({"format": fmt, "config": config}, cfg, fmt, shape_fields, sample_fields,
                                           cfg.allow_changes)[0]
        return problem and f"{where}: {problem}"
    return None


def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rng(seed, rank):
    """The per-rank RNG of a fresh start, also used when a resume at another world size re-derives it."""
    random.seed(seed * 1000 + rank)
    torch.manual_seed(seed * 1000 + rank)


def param_digest(state_dict):
    """sha256 over a full, unwrapped state dict: keys sorted; for each key, dtype, shape and raw bytes.
    The same weights give the same digest whatever the strategy or world size."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_newest(ckpt_dir, load):
    """(step, path, obj) of the newest committed checkpoint that `load(path)` reads without error,
    or (None, None, None). A read that fails is tried once more (the failure may be transient: a
    network filesystem, memory); one that fails twice is skipped, and nothing of it is applied,
    since `load` only reads. Once a checkpoint has loaded, the newer ones that did not are moved
    aside, never deleted; if none loads, nothing is moved. Call on one rank only."""
    unreadable = []
    for step, path in checkpoints(ckpt_dir):
        for attempt in (1, 2):
            try:
                obj = load(path)
            except Exception as e:  # any failure to read means: not this one, after a second try
                print(f"checkpoint {path} unreadable ({type(e).__name__}: {str(e)[:120]})"
                      + (": trying once more" if attempt == 1 else ": falling back to the previous one"), flush=True)
                continue
            for newer in unreadable:
                move_aside(newer, "did not load")
            return step, path, obj
        unreadable.append(path)
    return None, None, None


@dataclass
class PendingSave:
    """A checkpoint being saved (ddp and rpc: one file, written by rank 0). blocking_s is what the training
    loop waited for it: all of a synchronous save; for an async one the CPU copy (staging_s), then the
    wait for its write before the next save (not the wait at the end of the job: no step is left to
    stall). `future` is the write in its thread (its result: the bytes written)."""
    step: int
    t0: float
    blocking_s: float = 0.0
    staging_s: Optional[float] = None
    done_at: Optional[float] = None
    future: Optional[Future] = None


class BaseCheckpointer:
    """When a script saves, and the rungs of its resume that every script shares: a script's
    Checkpointer subclasses it with what its checkpoint holds, write(step, asynchronous) -> the save
    still in flight or None, commit(pending, in_loop), and load(), the resume from disk.

    The loop calls save(step, stop) after each step: it starts the memory tier's snapshot when one is
    due, and writes a disk checkpoint every --save-every steps (--save-every 0: an interval by Young
    and Daly's rule), at the last step, and when the job is stopped (a preemption: then it exits 143
    for a restart), one save in flight at a time. finish() at the end commits the last save.
    `snapshots` is the memory tier (tiers/snapshot.py) or None, `faults` the tests' faults
    (tiers/faults.py) or None, `guard` the StepGuard (common/dist.py), `step_times` the loop's list."""

    def __init__(self, cfg, rank, world, device, model, optimizer, monitor, guard, step_times, snapshots, faults):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model, self.optimizer, self.monitor, self.guard = model, optimizer, monitor, guard
        self.step_times, self.snapshots, self.faults = step_times, snapshots, faults
        self.ckpt_dir = Path(cfg.run_dir) / "ckpt"
        self.save_every = cfg.save_every or FIRST_AUTO_SAVE  # --save-every 0: a first save measures the cost
        self.pending = None  # the save in flight (--async-save), if any
        self.archived = None  # --archive, rank 0: what this attempt archived (step, bytes, seconds, attempts)

    def save(self, step, stop=False):
        """After step `step`: a memory snapshot (copied in a thread while the next step computes) and a
        disk checkpoint, each when due; then, if the job was stopped before its last step, exit 143."""
        if self.snapshots:
            self.snapshots.start(step, rng_state(), self.faults.in_snapshot(step) if self.faults else None)
        if getattr(self.cfg, "light_every", None) and step % self.cfg.light_every == 0:
            self.save_light(step)
        if step % self.save_every == 0 or step == self.cfg.steps or stop:
            t0 = time.perf_counter()
            with self.guard.patient():  # the other ranks may wait while rank 0 writes or prunes
                if self.pending:  # one save in flight at a time: the previous one commits first
                    self.commit(self.pending)
                self.pending = self.write(step, asynchronous=self.cfg.async_save and not stop)
            if not self.cfg.save_every:  # the interval from what this save cost the loop
                self.save_every = auto_save_every(time.perf_counter() - t0, self.step_times, self.cfg.mtbf_h,
                                                  self.device)
        if stop and step < self.cfg.steps:  # saved: exit non-zero, so that torchrun (or the scheduler) restarts the job
            self.monitor.event("preempted", step=step, signalled_at=self.guard.signalled_at)
            print0(f"preempted (SIGTERM or SIGUSR1): step {step} saved, exiting for a restart")
            raise SystemExit(PREEMPTED)

    def prune(self, step):
        """After the commit of `step`, on rank 0: keep-K (see prune_and_archive)."""
        prune_and_archive(self.cfg, self.ckpt_dir, step, self.monitor)

    def save_light(self, step):
        """--light-every: the model's weights alone, as one file a plain torch.load reads (the keys of the
        unwrapped model's state_dict, as --export writes them): rank 0's light/step-NNNNNNNN.pt, committed
        by its rename, --light-keep of them kept. Never a resume's: it looks in ckpt/ only. A failed write
        stops the job as a failed save does (exit 3)."""
        t0, error, nbytes = time.perf_counter(), None, 0
        weights = self.full_weights()  # FSDP: gathered, a collective
        light_dir = Path(self.cfg.run_dir) / "light"
        if self.rank == 0:
            try:
                light_dir.mkdir(exist_ok=True)
                path = light_dir / step_name(step, ".pt")
                nbytes = atomic_save({k: v.detach().cpu() for k, v in weights.items()}, path)
                prune(light_dir, self.cfg.light_keep, step)
            except OSError as e:
                error = e
        if not agree(error is None, self.device):
            fail(f"saving the light checkpoint of step {step} failed ({getattr(error, 'strerror', None) or error})"
                 if self.rank == 0 else None, code=3)
        self.monitor.event("light", step=step, bytes=nbytes, blocking_s=time.perf_counter() - t0)

    def full_weights(self):
        """The model's whole state_dict on rank 0 (DDP: the unwrapped model's; fsdp/checkpoint.py gathers it)."""
        return self.model.state_dict()

    def report(self, step, nbytes, blocking_s, staging_s, total_s, **more):
        """The save of `step` has committed: its event in the metrics, its line on the console."""
        self.monitor.event("save", step=step, blocking_s=blocking_s, staging_s=staging_s, total_s=total_s,
                           bytes=nbytes, **more)
        print0(f"saved step {step} ({nbytes / 2**20:.1f} MiB, blocking {blocking_s * 1000:.0f} ms,"
               + (f" staged in {staging_s * 1000:.0f} ms," if staging_s is not None else "")
               + f" total {total_s * 1000:.0f} ms)")
        self.pending = None

    def in_flight(self, t0):
        """What the step that started at `t0` overlapped, for its metrics: an async save's write, the
        memory tier's wait."""
        saving = self.pending is not None and (self.pending.done_at or math.inf) > t0
        return {"saving": saving, **({"snapshot_s": self.snapshots.blocked_s} if self.snapshots else {})}

    def finish(self):
        """The end of the job, or a diverged loss: the save in flight, of an earlier step, commits."""
        set_collective_timeout(self.cfg.timeout_s)  # the long timeout, as in a save
        if self.pending:
            self.commit(self.pending, in_loop=False)
        self.archived = close_archive(self.cfg, self.ckpt_dir, self.monitor) if self.rank == 0 else None

    def resume(self, launched_at):
        """Restore the state from the newest source that loses the least: a memory snapshot newer than the
        disk's newest checkpoint (the memory tier), else the newest checkpoint on disk (the script's
        load()), else a fresh start. Logs the attempt's start event (`launched_at`: the process's
        start). Returns the step resumed from, or None."""
        step = self.load_from_memory() if self.snapshots else None
        if self.rank == 0:  # --archive: a run folder without checkpoints gets the archive's newest
            fetch_archived(self.cfg, self.ckpt_dir, self.monitor, fetch=step is None)
        if step is None:
            step = self.load()
        self.monitor.event("start", launched_at=launched_at, resumed_from_step=step,
                           restarts=restarts(), world_size=self.world, pid=os.getpid())
        return step

    def load_from_memory(self):
        """The memory tier's newest snapshot, if every rank can restore it and it is newer than the disk's
        newest checkpoint. Returns the step restored, or None."""
        t0, committed = time.perf_counter(), checkpoints(self.ckpt_dir) if self.rank == 0 else None
        step = self.snapshots.resume(committed[0][0] if committed else None, self.device)
        if step is not None:
            self.monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(self.snapshots.folder),
                               source="memory")
            print0(f"resuming from step {step} (memory snapshot)")
        return step


# ----------------------------------------------------------------------------- --archive
# Rank 0's calls to the object-store tier (tiers/archive.py), imported only when --archive is set.
def archive_of(cfg):
    """This process's uploader of --archive (started at the first call), or None without the flag."""
    if not getattr(cfg, "archive", ""):
        return None
    from tiers.archive import open_archive
    return open_archive(cfg.archive, dataclasses.asdict(cfg))


def prune_and_archive(cfg, ckpt_dir, step, monitor):
    """After the commit of `step`, on rank 0: keep-K, but, with --archive, never a checkpoint not yet
    archived; and the step goes to the uploader."""
    archive = archive_of(cfg)
    prune(ckpt_dir, cfg.keep, step, held=archive.held if archive else ())
    if archive:
        archive.committed(step, next(path for s, path in checkpoints(ckpt_dir) if s == step), monitor)


def fetch_archived(cfg, ckpt_dir, monitor, fetch=True):
    """Before a resume, on rank 0, with --archive: a run folder that holds no committed checkpoint gets the
    archive's newest whole step (unless the memory tier restored a step: `fetch` False), where the
    script's load finds it; the newest local commit goes to the uploader (an earlier attempt may have
    ended before it was archived). A store that does not answer is a crash (torchrun tries again), never
    a fresh start over the archive."""
    archive = archive_of(cfg)
    if archive is None:
        return
    if fetch and not checkpoints(ckpt_dir):
        from tiers.archive import fetch_newest
        try:
            step, nbytes, seconds = fetch_newest(cfg.archive, ckpt_dir)
        except Exception as e:
            print(f"could not read the archive {cfg.archive} ({type(e).__name__}: {str(e)[:120]}): not starting "
                  "fresh over it", flush=True)
            raise SystemExit(1)
        if step is not None:
            monitor.event("fetch", step=step, bytes=nbytes, fetch_s=seconds, source=cfg.archive)
    committed = checkpoints(ckpt_dir)
    if committed:
        archive.submit(*committed[0])


def close_archive(cfg, ckpt_dir, monitor):
    """At the end of a job, on rank 0, with --archive: wait up to --timeout-s for the uploader (a finished
    run is whole in the store), then apply keep-K to what it held back. Returns what this attempt archived
    (step, bytes, seconds, attempts each), for the summary; None without --archive."""
    archive = archive_of(cfg)
    if archive is None:
        return None
    archive.close(cfg.timeout_s, monitor)
    committed = checkpoints(ckpt_dir)
    if committed:
        prune(ckpt_dir, cfg.keep, committed[0][0], held=archive.held)
    return archive.archived


def young_daly_steps(save_s, step_s, mtbf_h, device):
    """(steps, save_s, step_s, seconds): the disk interval that loses the least expected time to saving
    and to replaying after a failure, sqrt(2 x a save's cost x the mean time between failures) (Young
    1974, Daly 2006), in whole steps. The ranks take the largest of their measurements: a save is
    collective, so they must all choose the same interval."""
    measured = torch.tensor([save_s, step_s], dtype=torch.float64, device=device)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    save_s, step_s = measured.tolist()
    seconds = math.sqrt(2 * save_s * mtbf_h * 3600)
    return max(1, round(seconds / step_s)), save_s, step_s, seconds


FIRST_AUTO_SAVE = 10  # --save-every 0: the step of the first save, whose cost sets the interval


def auto_save_every(save_s, step_times, mtbf_h, device):
    """--save-every 0: the disk interval (young_daly_steps) after a save that blocked the loop `save_s`,
    with this attempt's median step time and --mtbf-h; printed after each save, with its numbers."""
    steps, save_s, step_s, seconds = young_daly_steps(save_s, statistics.median(step_times[-50:]), mtbf_h, device)
    if dist.get_rank() == 0:
        print(f"save every {steps} steps: sqrt(2 x {save_s * 1000:.1f} ms a save x {mtbf_h} h between "
              f"failures) = {seconds:.3f} s, at {step_s * 1000:.3f} ms a step (Young and Daly)", flush=True)
    return steps
