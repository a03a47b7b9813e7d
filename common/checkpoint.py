"""Checkpoint mechanics shared by the scripts: atomic write, committed-checkpoint lookup,
keep-last-K, RNG capture, and the parameter digest.

What a checkpoint contains, and how it is restored, stays in each script.

Layout: <run-dir>/ckpt/step-NNNNNNNN.pt (one file, committed by its atomic rename) or
<run-dir>/ckpt/step-NNNNNNNN/ (a DCP folder, committed once its `.metadata` exists, which DCP
writes last). Anything else in ckpt/ (temp files, uncommitted folders) is never loaded.
"""
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from common.model import SHAPE_FIELDS

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


def atomic_write(path, write, before_commit=None):
    """Write a file through `write(f)` to a temp file in the same folder, fsync, rename, fsync the folder.

    A crash at any point leaves either the old state or the complete new file, never a partial
    `path`. `before_commit` runs when the bytes are on disk but not yet committed (fault injection).
    Returns the number of bytes written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
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


def remove(path):
    shutil.rmtree(path, ignore_errors=True) if Path(path).is_dir() else Path(path).unlink(missing_ok=True)


def prune(ckpt_dir, keep):
    """Keep the newest `keep` committed checkpoints; drop uncommitted folders older than the newest
    committed one (left by a crash; a newer one may still be being written by an async save).
    Call on one rank only, after a commit."""
    done = checkpoints(ckpt_dir)
    for _, path in done[keep:]:
        remove(path)
    newest = done[0][0] if done else -1
    for step, path in checkpoints(ckpt_dir, committed=False):
        if step < newest:
            remove(path)
    for tmp in Path(ckpt_dir).glob(".step-*.tmp-*"):  # temp files of saves that died before their rename
        tmp.unlink(missing_ok=True)


def shape_mismatch(saved_cfg, cfg):
    """None, or a message naming the model-shape fields that differ between a checkpoint and this run."""
    diff = [f"{k}={saved_cfg.get(k)} (this run: {getattr(cfg, k)})" for k in SHAPE_FIELDS
            if saved_cfg.get(k) != getattr(cfg, k)]
    return "checkpoint was made with " + ", ".join(diff) if diff else None


def newest_shape_problem(ckpt_dir, cfg, read_config):
    """A one-line problem if the newest readable checkpoint was made for another model shape, else None.
    `read_config(path)` returns the config saved in a checkpoint; unreadable ones are skipped (the
    resume falls back past them)."""
    for _, path in checkpoints(ckpt_dir):
        try:
            saved = read_config(path)
        except Exception:
            continue
        mismatch = shape_mismatch(saved, cfg)
        return mismatch and f"{path}: {mismatch}; use another --run-dir"
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
    or (None, None, None). An unreadable one (truncated, corrupt) is reported and skipped; nothing
    of it is applied, since `load` only reads."""
    for step, path in checkpoints(ckpt_dir):
        try:
            return step, path, load(path)
        except Exception as e:  # any failure to read means: not this one
            print(f"checkpoint {path} unreadable ({type(e).__name__}: {str(e)[:120]}): "
                  "falling back to the previous one", flush=True)
    return None, None, None
