"""When a script saves, the resume's shared rungs (BaseCheckpointer), and the interval by Young and Daly's rule.

A tier (the memory tier, the light checkpoints, the archive) is an object the script opens in its flag's
block and hands over in `tiers`. The checkpointer calls the tiers that have these methods, in list order:
    after_step(step, checkpointer)  every step, before a disk save is due: a memory snapshot, a light checkpoint
    pinned()                        rank 0, keep-K: the steps not to delete yet (not yet copied elsewhere)
    committed(step, path)           rank 0: the checkpoint of `step` has committed at `path`
    restore(checkpointer)           a resume's first rung: the step the tier restored, or None (the next one)
    before_load(restored)           before the disk's rung (`restored`: the step restored already, or None)
    in_flight()                     what the step overlapped, for its metrics: a dict
    preempted(step)                 the job stops for a restart, `step` committed on disk: what it held of it goes
    finish(done)                    the end of the job (`done`), or a stop: what the tier holds is closed
    summary()                       rank 0's fields of summary.json: a dict
"""
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import checkpoints, prune
from common.dist import PREEMPTED, print0, restarts, set_collective_timeout


class BaseCheckpointer:
    """A script's Checkpointer adds what its checkpoint holds: write(step, asynchronous) -> the save in flight
    or None, commit(pending, in_loop), and load(), the resume from disk."""

    def __init__(self, cfg, rank, world, device, model, optimizer, monitor, guard, step_times, tiers=()):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model, self.optimizer, self.monitor, self.guard = model, optimizer, monitor, guard
        self.step_times, self.tiers = step_times, [tier for tier in tiers if tier is not None]
        self.ckpt_dir = Path(cfg.run_dir) / "ckpt"
        self.save_every = cfg.save_every or FIRST_AUTO_SAVE  # --save-every 0: a first save measures the cost
        self.pending = None  # the save in flight (--async-save), if any

    def each(self, hook, *args):
        """The results of the tiers' `hook(*args)`, in their order, from those that have it."""
        return [getattr(tier, hook)(*args) for tier in self.tiers if hasattr(tier, hook)]

    def save(self, step, stop=False):
        """After each step: the tiers' after_step, then a disk save every --save-every steps, at the last step
        and on `stop` (a preemption, which then exits 143 for a restart), one save in flight at a time."""
        self.each("after_step", step, self)
        if step % self.save_every == 0 or step == self.cfg.steps or stop:
            t0 = time.perf_counter()
            with self.guard.patient():  # the other ranks may wait while rank 0 writes or prunes
                if self.pending:  # one save in flight at a time: the previous one commits first
                    self.commit(self.pending)
                self.pending = self.write(step, asynchronous=self.cfg.async_save and not stop)
            if not self.cfg.save_every:  # the interval from what this save cost the loop
                self.save_every = auto_save_every(time.perf_counter() - t0, self.step_times, self.cfg.mtbf_h,
                                                  self.device)
        if stop and step < self.cfg.steps:  # committed (a stop's save is synchronous): exit non-zero for a restart
            self.each("preempted", step)
            self.monitor.event("preempted", step=step, signalled_at=self.guard.signalled_at)
            print0(f"the job ends (its supervisor says why): step {step} saved, exiting" if self.guard.ended else
                   f"preempted (SIGTERM or SIGUSR1): step {step} saved, exiting for a restart")
            raise SystemExit(PREEMPTED)

    def prune(self, step):
        """After the commit of `step`, on rank 0: keep-K, never a step a tier holds; then the tiers hear of it."""
        prune(self.ckpt_dir, self.cfg.keep, step, held=set().union(*self.each("pinned")))
        if any(hasattr(tier, "committed") for tier in self.tiers):
            self.each("committed", step, next(path for s, path in checkpoints(self.ckpt_dir) if s == step))

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
        """What the step that started at `t0` overlapped, for its metrics: an async save, and the tiers'."""
        saving = self.pending is not None and (self.pending.done_at or math.inf) > t0
        return {"saving": saving, **{k: v for fields in self.each("in_flight") for k, v in fields.items()}}

    def finish(self, done=False):
        """At the end (`done`) or a diverged loss: the save in flight, of an earlier step, commits; the tiers close."""
        set_collective_timeout(self.cfg.timeout_s)  # the long timeout, as in a save
        if self.pending:
            self.commit(self.pending, in_loop=False)
        self.each("finish", done)

    def summary(self):
        """The tiers' fields of summary.json."""
        return {k: v for fields in self.each("summary") for k, v in fields.items()}

    def resume(self, launched_at):
        """Restore from a tier (a memory snapshot, newer than the disk's), else the disk (load()), else start
        fresh; log the attempt's start. Returns the step resumed from, or None."""
        step = self.restore()
        self.each("before_load", step)  # (the archive: a run folder without checkpoints gets its newest)
        if step is None:
            step = self.load()
        self.monitor.event("start", launched_at=launched_at, resumed_from_step=step,
                           restarts=restarts(), world_size=self.world, pid=os.getpid())
        return step

    def restore(self):
        """The step the first tier that has one restored, or None."""
        return next((step for step in self.each("restore", self) if step is not None), None)


def young_daly_steps(save_s, step_s, mtbf_h, device):
    """(steps, save_s, step_s, seconds): the interval losing the least time, sqrt(2 x a save's cost x the mean
    time between failures) (Young 1974, Daly 2006), from the ranks' largest costs: all must choose the same."""
    measured = torch.tensor([save_s, step_s], dtype=torch.float64, device=device)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    save_s, step_s = measured.tolist()
    seconds = math.sqrt(2 * save_s * mtbf_h * 3600)
    return max(1, round(seconds / step_s)), save_s, step_s, seconds


FIRST_AUTO_SAVE = 10  # --save-every 0: the step of the first save, whose cost sets the interval


def auto_save_every(save_s, step_times, mtbf_h, device):
    """--save-every 0: young_daly_steps after a save that blocked the loop `save_s`, printed with its numbers."""
    steps, save_s, step_s, seconds = young_daly_steps(save_s, statistics.median(step_times[-50:]), mtbf_h, device)
    if dist.get_rank() == 0:
        print(f"save every {steps} steps: sqrt(2 x {save_s * 1000:.1f} ms a save x {mtbf_h} h between "
              f"failures) = {seconds:.3f} s, at {step_s * 1000:.3f} ms a step (Young and Daly)", flush=True)
    return steps
