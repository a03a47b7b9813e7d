"""Checkpoint mechanics the scripts share: atomic write, lookup, keep-last-K, moving unreadable ones aside, the
resume's settings check, RNG capture, the parameter digest. What a checkpoint holds stays in each script.

Layout: ckpt/step-NNNNNNNN.pt (a file, committed by its atomic rename) or ckpt/step-NNNNNNNN/ (a DCP folder,
committed once its `.metadata`, which DCP writes last, exists). Nothing else in ckpt/ is ever loaded.
"""
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch

from common.config import fail
from common.dist import print0

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
    """Keeps a failed write's OSError, which torch.save reports only as a RuntimeError about a position."""

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
    """Write `path` by `write(f)` into a fresh temp file (never through a link), fsync, rename, fsync the folder,
    and return its size: a crash leaves the old or the whole new file. `before_commit` runs just before the rename."""
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
    """Delete a checkpoint, first renamed so that no part of it is ever found; return whether it is gone.
    One that cannot be renamed is kept with one line: cleaning up is no reason to stop training."""
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
    """After the commit of `committed_step`, on one rank: keep it, the `keep - 1` before it and the steps `held`
    (not yet copied elsewhere); drop older uncommitted folders (a newer one may be an async save's)."""
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
    """Rename a checkpoint that did not load out of the lookup's sight, on one rank, and return the new path:
    a later save never lands in a folder that looks committed, and a person can still recover its bytes."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(path, aside)
    fsync_dir(path.parent)
    print(f"moved {path.name} aside to {aside.name} ({why}); it is kept for inspection, never loaded", flush=True)
    return aside


def refuse_unfit(saved, cfg, path, fmt, shape_fields, sample_fields):
    """resume_problem with `saved` (of `path`): a problem stops the job in one line (exit 2), changes are printed."""
    problem, changes = resume_problem(saved, cfg, fmt, shape_fields, sample_fields, cfg.allow_changes)
    if problem:
        fail(f"{path}: {problem}")
    if changes:
        print0(f"resuming with changed settings: {', '.join(changes)}")


def keeping_settings(optimizer, load):
    """Run load() on `optimizer`, keeping this run's param group settings: a changed flag applies on any resume."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    result = load()
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)
    return result


def restore_rng(rngs, saved_world, seed, step, rank, world):
    """Set this rank's RNG from `rngs` (every rank's), or at another world size, where a rank's stream cannot
    carry over, derive it from the seed and the step. Returns whether the world size changed."""
    if saved_world == world:
        set_rng_state(rngs[rank])
        return False
    seed_rng(seed + step, rank)
    return True


def resume_problem(saved, cfg, fmt, shape_fields, sample_fields, allow_changes=False):
    """(why not to resume from the record `saved`, or None; the changed settings, "lr 0.003 -> 0.01"). Changed
    `shape_fields` are always refused, changed `sample_fields` (which samples a step sees) unless `allow_changes`."""
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
    """resume_problem with the newest checkpoint `read_saved(path)` reads (the resume skips the others), or None."""
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
    return None


def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_to_json(state):
    """rng_state() as JSON values, so that a saved record or a peer's RNG is read without unpickling."""
    version, words, gauss = state["python"]
    out = {"python": [version, list(words), gauss], "torch": state["torch"].numpy().tobytes().hex()}
    if "cuda" in state:
        out["cuda"] = [t.numpy().tobytes().hex() for t in state["cuda"]]
    return out


def rng_from_json(saved):
    version, words, gauss = saved["python"]
    state = {"python": (version, tuple(words), gauss),
             "torch": torch.frombuffer(bytearray.fromhex(saved["torch"]), dtype=torch.uint8)}
    if "cuda" in saved:
        state["cuda"] = [torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8) for h in saved["cuda"]]
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
    """sha256 of a full state dict's sorted keys, dtypes, shapes and bytes: the same whatever the strategy."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_newest(ckpt_dir, load):
    """(step, path, obj) of the newest checkpoint `load(path)` reads, trying each twice (a network filesystem may
    fail once), or Nones; on one rank. The newer ones are then moved aside; if none loads, nothing is moved."""
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
