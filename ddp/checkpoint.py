"""ddp/train.py's checkpoint: one file ckpt/step-NNNNNNNN.pt that rank 0 writes (the unwrapped model, the
optimizer, step, world size, config and every rank's RNG), committed by its atomic rename. When to save is
common/checkpointer.py's; an async save writes a CPU copy of the state while training goes on."""
import dataclasses
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from common.checkpoint import (atomic_save, checkpoints, keeping_settings, load_newest, refuse_unfit, restore_rng,
                               rng_from_json, rng_state, rng_to_json, seed_rng, step_name)
from common.checkpointer import BaseCheckpointer
from common.config import fail
from common.dist import agree, gather_json, print0
from common.model import SHAPE_FIELDS

# The layout Checkpointer.write writes; a load refuses any other.
FORMAT = 2
# Settings a resume must keep: the model's shape (or the weights do not fit) and which samples a step sees.
SAMPLE_FIELDS = ("seed", "batch_size", "data")

# A checkpoint file as Checkpointer.write wrote it, its tensors on the CPU (load_state_dict moves them).
read_checkpoint = functools.partial(torch.load, map_location="cpu", weights_only=True)


class Checkpointer(BaseCheckpointer):
    """What a checkpoint holds (write), its commit, and the resume from disk (load)."""

    def __init__(self, *args, faults=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults  # the tests' (tiers/faults.py), or None
        self.write_pool = None  # --async-save: the one thread that writes rank 0's checkpoints
        if self.cfg.async_save:
            self.write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
            memory = "pinned" if self.device.type == "cuda" else "pageable"
            print0(f"async save: copied on the main thread into {memory} CPU memory, written in a background thread")

    def write(self, step, asynchronous):
        """Rank 0 writes what a bitwise resume needs; returns the PendingSave if `asynchronous`, else None. An async
        save copies the state to CPU memory first, after which training may change the weights."""
        t0 = time.perf_counter()
        rngs = [rng_from_json(r) for r in gather_json(rng_to_json(rng_state()))]  # every rank's, saved by rank 0
        pending = PendingSave(step, t0)
        if self.rank == 0:
            before_commit = self.faults.in_save(step) if self.faults else None
            state = {"format": FORMAT, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "step": step, "world_size": self.world, "rng": rngs, "config": dataclasses.asdict(self.cfg)}
            path = self.ckpt_dir / step_name(step, ".pt")
            if asynchronous:
                pin = self.device.type == "cuda"
                state = cpu_copy(state, pin)
                if pin:
                    torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
                pending.staging_s = time.perf_counter() - t0
                pending.future = self.write_pool.submit(atomic_save, state, path, before_commit=before_commit)
                pending.future.add_done_callback(lambda _: setattr(pending, "done_at", time.perf_counter()))
            else:
                pending.future = Future()  # done already: commit() reports it like an async one
                try:
                    pending.future.set_result(atomic_save(state, path, before_commit=before_commit))
                except Exception as e:  # a full disk: the previous checkpoints stay as they are
                    pending.future.set_exception(e)
        pending.blocking_s = time.perf_counter() - t0
        if self.rank != 0 and asynchronous:  # nothing of it is in flight on this rank
            pending.done_at = t0 + pending.blocking_s
        if asynchronous:
            return pending
        self.commit(pending)
        return None

    def commit(self, pending, in_loop=True):
        """Wait for rank 0's write; the ranks agree on its outcome, so that all stop after a failed write (exit 3,
        earlier checkpoints kept) and none runs ahead of an unfinished save."""
        t0, nbytes, error = time.perf_counter(), 0, None
        if pending.future is not None:
            try:
                nbytes = pending.future.result()
            except Exception as e:
                error = e
        if not agree(error is None, self.device):
            fail(f"saving step {pending.step} failed ({getattr(error, 'strerror', None) or error}): the checkpoints "
                 "of earlier steps are kept" if self.rank == 0 else None, code=3)
        if self.rank == 0:
            self.prune(pending.step)
        now = time.perf_counter()
        pending.blocking_s += now - t0 if in_loop else 0.0
        total_s = (pending.done_at or now) - pending.t0  # its callback may run after result()
        self.report(pending.step, nbytes, pending.blocking_s, pending.staging_s, total_s)

    def finish(self, done=False):
        super().finish(done)
        if self.write_pool:
            self.write_pool.shutdown()

    def load(self):
        """Restore the model, optimizer and RNG from the newest checkpoint that loads, or seed a fresh start;
        return the step or None. Rank 0 picks the file and every rank loads it, so all resume from one step."""
        cfg, rank, world = self.cfg, self.rank, self.world
        path, state, t0 = None, None, time.perf_counter()
        if rank == 0:
            _, path, state = load_newest(self.ckpt_dir, read_checkpoint)
        sent = gather_json(str(path) if path else None)[0]  # rank 0's
        path = Path(sent) if sent else None
        if path is None:
            if checkpoints(self.ckpt_dir):  # never train fresh over checkpoints that exist but do not load
                fail(f"no checkpoint in {self.ckpt_dir} loads (see above); remove the damaged ones or use another "
                     "--run-dir")
            seed_rng(cfg.seed, rank)
            print0("no checkpoint, starting fresh")
            return None
        if state is None:
            state = read_checkpoint(path)
        refuse_unfit(state, cfg, path, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
        self.model.load_state_dict(state["model"])
        keeping_settings(self.optimizer, lambda: self.optimizer.load_state_dict(state["optimizer"]))
        step = state["step"]
        if restore_rng(state["rng"], state["world_size"], cfg.seed, step, rank, world):
            print0(f"world size changed from {state['world_size']} to {world}: per-rank RNG re-derived")
        self.monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(path), source="disk")
        print0(f"resuming from step {step}")
        return step


@dataclass
class PendingSave:
    """A save in flight. blocking_s is what the loop waited for it: all of a synchronous save; of an async one, the
    CPU copy (staging_s) and the wait before the next save (not the one at the end: no step is left to stall)."""
    step: int
    t0: float
    blocking_s: float = 0.0
    staging_s: Optional[float] = None
    done_at: Optional[float] = None
    future: Optional[Future] = None


def cpu_copy(obj, pin, memo=None):
    """`obj` with its tensors copied into CPU memory, pinned and non-blocking if `pin` (synchronize before
    reading). A tensor met twice (tied weights) is copied once, as torch.save stores it once."""
    memo = {} if memo is None else memo
    if torch.is_tensor(obj):
        if id(obj) not in memo:
            copy = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin)
            memo[id(obj)] = copy.copy_(obj.detach(), non_blocking=pin)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return {k: cpu_copy(v, pin, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v, pin, memo) for v in obj)
    return obj
