"""The parameter server of rpc/ps.py: the model, the optimizer, the version (completed updates) and the
trainers, behind one lock. The script builds one ParameterServer on rank 0, hands it to set_server()
and runs wait_until_done() on its main thread; the trainers call the three *_remote functions by RPC.
Only those know of RPC: tests/test_rpc.py drives the object itself, pushing from plain threads.

sync (the default): an update waits for one gradient from every live trainer, all computed on the
current version, and averages them in trainer order, so arrival order cannot change the result. A
trainer still missing --straggler-timeout seconds after the first gradient arrived is dropped.

async: a push is queued with the version it was computed on and answered at once with the
newest weights, so no trainer waits for another. An update averages the first --updates-per-step
queued gradients, from any trainers, in arrival order; the push that completes them (or arrives
while they are complete) is answered by that update. A gradient computed more than --max-staleness
updates before the one that would apply it is dropped, and counted. It drops no trainer.

The server's checkpoint, ckpt/step-NNNNNNNN.pt (save_checkpoint writes it, resume reads it): the
model, the optimizer, the step, the RNG, the config, the trainers dropped and each trainer's steps,
committed by its atomic rename. At the end, kill_stuck_trainers kills a trainer of the server's node
that froze (torchrun would wait for it for ever).
"""
import dataclasses
import functools
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch.distributed.rpc.functions import async_execution

from common.checkpoint import (atomic_save, checkpoints, keeping_settings, load_newest, param_digest, prune,
                               refuse_unfit, rng_state, seed_rng, set_rng_state, step_name)
from common.config import fail
from common.data import lr_at
from common.dist import print0
from common.model import SHAPE_FIELDS
from common.stop import leave_stop_code
from common.monitor import state_bytes

SERVER = None  # the ParameterServer that the trainers' RPCs reach, in the server process: see set_server


def set_server(server):
    """Make `server` the one that ParameterServer.pull_remote, push_remote and leave_remote reach. RPC sends
    a function by module and name, so each finds SERVER here, in rpc.server, and not in the script."""
    global SERVER
    SERVER = server


# ----------------------------------------------------------------------------- the server's state
class Pushed(NamedTuple):
    """A gradient waiting for an update, and where its answer goes."""
    trainer: int
    trainer_step: int  # which step of the trainer's own (sync: the server's step)
    version: int  # the server step it was computed on
    grads: list
    loss: float
    reply: torch.futures.Future


class Reply(NamedTuple):
    """What a trainer gets back from a pull or a push: the weights after `step` updates, or why it stops."""
    step: int
    weights: Optional[dict]
    stop: Optional[str] = None  # set: the trainer stops (it was dropped, the server stopped, or is gone)
    trainer_step: int = 0  # a pull's: the trainer's steps the server has taken (async: where the trainer goes on)


class ParameterServer:
    """The model, the optimizer, the version (completed updates) and the trainers, behind one lock.

    push() runs on RPC threads and only records a gradient (async: and answers it with the newest
    weights, unless it completes an update). The main thread, in wait_until_done(), runs every update
    whole under the lock: gradients in, optimizer step, checkpoint, replies out. So no push sees half
    an update, and a failure in one (a diverged loss, a failed save, an injected crash) ends the
    process from its main thread."""

    def __init__(self, model, optimizer, cfg, monitor, trainers, version, lost, after_update, trainer_steps=None):
        self.model, self.optimizer, self.cfg, self.monitor = model, optimizer, cfg, monitor
        self.rows_per_trainer = cfg.batch_size // trainers
        self.tokens_per_trainer = self.rows_per_trainer * cfg.seq_len
        self.lost = dict(lost)  # trainer rank -> the step it was dropped at; it stays dropped for the job
        self.live = set(range(1, trainers + 1)) - self.lost.keys()  # the trainers an update waits for
        self.version = version
        self.after_update = after_update  # after_update(server, step): fault injection and checkpoint, under the lock
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # wakes the main thread
        self.pushed = []  # gradients not applied yet: sync, this version's; async, in arrival order
        self.updates_per_step = cfg.updates_per_step or len(self.live)  # async: gradients an update averages
        self.trainer_steps = dict(trainer_steps or {})  # trainer rank -> its steps applied or dropped
        self.staleness, self.stale_dropped = [], 0  # of each gradient applied; how many were dropped
        self.left = set()  # trainers that have the last update's weights and said so
        self.version_started = self.waiting_since = time.monotonic()
        self.step_times, self.loss = [], None
        self.reply = self.reply_copy()

    def reply_copy(self):
        """The Reply every pull and push gets until the next update: a copy of the weights, so that no
        reply in flight can see a later update's weights."""
        return Reply(self.version, {k: v.detach().clone() for k, v in self.model.state_dict().items()})

    def pull(self, trainer):
        with self.lock:
            if trainer not in self.live:
                return Reply(self.version, None, "dropped by the server")
            return self.reply._replace(trainer_step=self.trainer_steps.get(trainer, 0))

    def push(self, trainer, version, grads, loss, trainer_step=None):
        """A future of the Reply to this push of a gradient computed on `version` at the trainer's own
        `trainer_step` (None: the version, as in sync), completed by the next update (or at once if the
        trainer was dropped). async: at once with the newest weights, unless an update is due."""
        future = torch.futures.Future()
        with self.lock:
            if trainer not in self.live:
                future.set_result(Reply(self.version, None, "dropped by the server"))
            elif self.cfg.mode == "sync" and version != self.version:
                future.set_exception(ValueError(f"trainer {trainer} pushed for step {version}, "
                                                f"the server is at step {self.version}"))
            else:
                if not self.pushed:  # the first gradient waiting: the straggler clock starts
                    self.waiting_since = time.monotonic()
                own_step = version if trainer_step is None else trainer_step
                self.pushed.append(Pushed(trainer, own_step, version, grads, loss, future))
                if self.cfg.mode == "async" and not self.update_due():
                    future.set_result(self.reply)
                self.changed.notify_all()
        return future

    def leave(self, trainer):
        """A trainer has the last update's weights: the server need not stay up for it."""
        with self.lock:
            self.left.add(trainer)
            self.changed.notify_all()

    @staticmethod
    def pull_remote(trainer):
        return SERVER.pull(trainer)

    @staticmethod
    @async_execution  # the RPC thread returns at once; the reply is sent when the future completes
    def push_remote(trainer, version, grads, loss, trainer_step):
        return SERVER.push(trainer, version, grads, loss, trainer_step)

    @staticmethod
    def leave_remote(trainer):
        SERVER.leave(trainer)

    def update_due(self):
        """sync: every live trainer has pushed. async: --updates-per-step fresh enough gradients wait."""
        if self.version >= self.cfg.steps or not self.pushed:
            return False
        if self.cfg.mode == "sync":
            return self.live <= {p.trainer for p in self.pushed}
        fresh = sum(self.version - p.version <= self.cfg.max_staleness for p in self.pushed)
        return fresh >= self.updates_per_step

    def drop_stale(self):
        """async: the gradients now more than --max-staleness updates old are counted, never applied."""
        fresh = []
        for p in self.pushed:
            if self.version - p.version <= self.cfg.max_staleness:
                fresh.append(p)
                continue
            self.trainer_steps[p.trainer] = p.trainer_step + 1
            self.stale_dropped += 1
            self.monitor.event("stale_dropped", step=self.version, trainer=p.trainer, trainer_step=p.trainer_step,
                               version=p.version)
            answer([p], self.reply)
        self.pushed = fresh

    def update(self):
        """Average the gradients of an update, step, save, answer. Main thread, under the lock. sync: every
        live trainer's, in trainer order (so arrival order cannot change the result); async: the first
        --updates-per-step queued, in arrival order."""
        if self.cfg.mode == "sync":
            taken, self.pushed = sorted(self.pushed, key=lambda p: p.trainer), []
        else:
            taken, self.pushed = self.pushed[:self.updates_per_step], self.pushed[self.updates_per_step:]
        step = self.version + 1
        loss = sum(p.loss for p in taken) / len(taken)
        if not math.isfinite(loss):  # diverged: stop before the weights change and anything is saved
            answer(taken + self.pushed, Reply(self.version, None, f"the server stopped: loss {loss}"))
            fail(f"loss is {loss} at step {step}: stopping without saving, the checkpoints of earlier steps are kept",
                 code=3)
        for i, param in enumerate(self.model.parameters()):
            param.grad = sum(p.grads[i] for p in taken) / len(taken)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = lr_at(self.cfg, self.version)  # a function of the step: a resume, even with a new --lr, needs no schedule
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.staleness += [self.version - p.version for p in taken]  # sync: 0
        self.trainer_steps.update((p.trainer, p.trainer_step + 1) for p in taken)  # saved by after_update
        self.version, self.loss = step, loss
        dt = time.monotonic() - self.version_started
        self.step_times.append(dt)
        self.reply = self.reply_copy()
        pushed_bytes = sum(g.numel() * g.element_size() for p in taken for g in p.grads)
        pulled_bytes = len(taken) * sum(v.numel() * v.element_size() for v in self.reply.weights.values())
        self.monitor.step(step, loss, lr, dt, self.tokens_per_trainer * len(taken),
                          state_bytes(self.model, self.optimizer), updates_per_s=1 / dt,
                          bytes_moved=pushed_bytes + pulled_bytes, trainers=len({p.trainer for p in taken}),
                          applied=[(p.trainer, p.trainer_step, p.version) for p in taken])
        self.after_update(self, step)  # before any trainer sees the new version
        answer(taken + self.pushed, self.reply)  # async: also the pushes that arrived while this one was due
        self.version_started = self.waiting_since = time.monotonic()

    def wait_until_done(self):
        """Main thread: run every update, and return after the last. An update runs once every live
        trainer has pushed. A trainer whose gradient is still missing --straggler-timeout seconds after
        the first one arrived is dropped, and the update goes ahead without it. The clock starts at the
        first gradient, not at the version's start, so that a slow start (import, first step) is never
        taken for a lost trainer; no gradient at all for --timeout-s is an error. async: an update runs
        once enough fresh gradients wait; as it waits for no trainer in particular, it drops none."""
        with self.lock:
            while self.version < self.cfg.steps:
                if self.cfg.mode == "async":
                    self.drop_stale()
                if self.update_due():
                    self.update()
                    continue
                stragglers = self.cfg.mode == "sync" and self.pushed  # some pushed: the others are late
                limit = self.cfg.straggler_timeout if stragglers else self.cfg.timeout_s
                waited = time.monotonic() - self.waiting_since
                if waited < limit:
                    self.changed.wait(limit - waited)
                    continue
                if not stragglers:
                    raise RuntimeError(f"no update after step {self.version} in {waited:.0f} s "
                                       f"({len(self.pushed)} gradients pushed)")
                for t in sorted(self.live - {p.trainer for p in self.pushed}):
                    self.live.remove(t)
                    self.lost[t] = self.version
                    self.monitor.event("trainer_lost", step=self.version, trainer=t, waited_s=waited)
                    print(f"trainer {t} lost: no gradient for step {self.version} after {waited:.1f} s; "
                          f"continuing with {len(self.live)} trainers", flush=True)

    def wait_for_leaves(self):
        """After the last update: wait until every live trainer has said it has the last weights, at
        most --straggler-timeout seconds. Returns the trainers not heard from (frozen or dead since)."""
        deadline = time.monotonic() + self.cfg.straggler_timeout
        with self.lock:
            while not self.live <= self.left and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            return sorted(self.live - self.left)

    def skipped_rows(self):
        """Per lost trainer: the rows [start, end) of every global batch that it owned and no one trained
        on, from `from_step` (the first update without it) to the end."""
        n = self.rows_per_trainer
        return [{"trainer": t, "rows": [(t - 1) * n, t * n], "from_step": step + 1}
                for t, step in sorted(self.lost.items())]


def answer(pushes, reply):
    """Complete the futures of `pushes` not answered yet (async answers most pushes at once)."""
    for p in pushes:
        if not p.reply.done():
            p.reply.set_result(reply)


# ----------------------------------------------------------------------------- the server's checkpoint
# The layout of the server's ckpt/step-NNNNNNNN.pt, written by save_checkpoint() and read by resume(): a load
# (and check(), before the job starts) refuses any other.
FORMAT = 2
# Settings a resume must keep: the model's shape (or the weights do not fit) and which samples a step sees.
SAMPLE_FIELDS = ("seed", "batch_size", "data")

# A checkpoint file as save_checkpoint wrote it, its tensors on the CPU (load_state_dict moves them).
read_checkpoint = functools.partial(torch.load, map_location="cpu", weights_only=True)


def state_digest(model, optimizer):
    """A digest of the weights and the optimizer state: a resume must load exactly what the save wrote."""
    optim = {f"optimizer.{i}.{k}": v for i, state in optimizer.state_dict()["state"].items() for k, v in state.items()}
    return param_digest({**model.state_dict(), **optim})


def save_checkpoint(server, ckpt_dir, world, step, archive=None, before_commit=None):
    """Write the server's checkpoint of `step` (everything a resume needs) and prune the older ones (with
    --archive, `archive`: not those it holds), then hand it to `archive`. `before_commit`: a hook run once
    the bytes are written, before the commit (the tests' faults)."""
    t0 = time.perf_counter()
    model, optimizer, cfg = server.model, server.optimizer, server.cfg
    digest = state_digest(model, optimizer)  # in the checkpoint and its save event: a resume reports it
    try:
        nbytes = atomic_save({
            "format": FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "step": step, "world_size": world, "rng": rng_state(), "config": dataclasses.asdict(cfg),
            "lost": server.lost, "trainer_steps": server.trainer_steps, "digest": digest,
        }, ckpt_dir / step_name(step, ".pt"), before_commit=before_commit)
    except OSError as e:  # a full disk: the previous checkpoints stay as they are
        fail(f"saving step {step} failed ({e.strerror or e}): the checkpoints of earlier steps are kept", code=3)
    prune(ckpt_dir, cfg.keep, step, held=archive.pinned() if archive else ())
    if archive:
        archive.committed(step, ckpt_dir / step_name(step, ".pt"))
    save_s = time.perf_counter() - t0
    server.monitor.event("save", step=step, blocking_s=save_s, total_s=save_s, bytes=nbytes, digest=digest)
    print0(f"saved step {step} ({nbytes / 2**20:.1f} MiB, {save_s * 1000:.0f} ms)")


@dataclass
class Resumed:
    """Where the server goes on from (as it is for a fresh start unless a checkpoint loaded)."""
    step: int = 0  # completed updates
    resumed_from: Optional[int] = None  # the step of the checkpoint loaded; None: started fresh
    lost: dict = dataclasses.field(default_factory=dict)  # trainer rank -> the step it was dropped at
    trainer_steps: dict = dataclasses.field(default_factory=dict)  # trainer rank -> its steps applied or dropped


def resume(ckpt_dir, model, optimizer, cfg, world, monitor):
    """Restore the model, the optimizer and the RNG from the newest checkpoint that loads, after checking
    that it fits this job; seed the RNG if there is none. Never trains fresh over checkpoints that exist
    but do not load."""
    _, path, state = load_newest(ckpt_dir, read_checkpoint)
    if state is None:
        if checkpoints(ckpt_dir):
            fail(f"no checkpoint in {ckpt_dir} loads (see above); remove the damaged ones or use another --run-dir")
        seed_rng(cfg.seed, 0)  # the server is rank 0
        print0("no checkpoint, starting fresh")
        return Resumed()
    t0 = time.perf_counter()
    refuse_unfit(state, cfg, path, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
    # format and config: checked above; digest: reported below, beside the digest of what loaded.
    model.load_state_dict(state["model"])
    keeping_settings(optimizer, lambda: optimizer.load_state_dict(state["optimizer"]))
    set_rng_state(state["rng"])
    lost = {}
    if state["world_size"] == world:  # a dropped trainer stays dropped: the batches stay those of the first run
        lost = state["lost"]
    else:  # other ranks: the saved ranks of lost trainers may not exist
        print0(f"world size changed from {state['world_size']} to {world}: all {world - 1} trainers live")
    monitor.event("load", step=state["step"], load_s=time.perf_counter() - t0, path=str(path),
                  digest=state_digest(model, optimizer), saved_digest=state.get("digest"))
    print0(f"resuming from step {state['step']}")
    return Resumed(state["step"], resumed_from=state["step"], lost=lost,
                   trainer_steps=state["trainer_steps"])  # async trainers go on after them


# ----------------------------------------------------------------------------- teardown: trainers that froze
def kill_stuck_trainers(trainers, wait_s):
    """Kill those of `trainers` (ranks the server did not hear from at the end) that run on this node and
    still run `wait_s` seconds after the end. torchrun ends a job only once every worker has exited, so a
    trainer that froze would hold the job for ever. Killing one makes torchrun restart the group; the
    job's code (0), left for the launcher first, makes that restart end at once (end_if_stopped)."""
    stuck = still_running(trainers, wait_s)
    if not stuck:
        return
    leave_stop_code(0)
    print(f"trainers {sorted(stuck)} still running {wait_s} s after the end: killed, as "
          "torchrun waits for every worker", flush=True)
    for pid in stuck.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass


def still_running(ranks, wait_s):
    """{rank: pid} of the workers of `ranks` on this node still running after up to `wait_s` seconds. They
    are this process's siblings (torchrun's agent started them all), found by their RANK in Linux's /proc."""
    deadline = time.monotonic() + wait_s
    while True:
        found = {}
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                state, parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
                if int(parent) != os.getppid() or state == "Z":  # not a sibling, or exited (not reaped yet)
                    continue
                env = dict(v.split("=", 1) for v in (proc / "environ").read_text(errors="replace").split("\0")
                           if "=" in v)
                if int(env.get("RANK", -1)) in ranks:
                    found[int(env["RANK"])] = int(proc.name)
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                continue
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)  # polling /proc for their exit
