"""A parameter server on torch.distributed.rpc that survives failures: a checkpointed server,
stateless trainers, and lost trainers dropped after a timeout.

    bash run.sh rpc 4                                  # torchrun, 4 processes: rank 0 the server, 1-3 trainers
    bash run.sh rpc 4 --steps 40 --save-every 10 --crash-at-step 25   # see a crash recovered
    bash run.sh rpc 4 --drop-trainer-at-step 10 --straggler-timeout 5  # see a lost trainer dropped
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 rpc/ps.py         # the variable: see run.sh (restarts rendezvous reliably)

Rank 0 holds the model and the optimizer. Each trainer pulls the weights, computes gradients on
its part of the step's batch and pushes them with rpc_async. Once every live trainer has pushed,
the server averages the gradients in trainer order (so arrival order cannot change the result),
steps, checkpoints, and answers every waiting trainer with the new weights. Trainers hold nothing
that the server's version does not determine: after a crash torchrun restarts every process, the
server resumes from its checkpoint and the trainers carry on from its version. A trainer that
stops pushing is dropped after --straggler-timeout seconds and the others carry on without it.
"""
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` from anywhere in the repo

import torch
import torch.distributed.rpc as rpc

from common.checkpoint import (atomic_save, atomic_write_json, checkpoints, load_newest, newest_shape_problem,
                               param_digest, prune, rng_state, seed_rng, set_rng_state, shape_mismatch, step_name)
from common.config import common_problems, fail, parse_config
from common.data import StepData
from common.dist import crash, first_attempt, pick_device, print0, restarts
from common.model import Transformer, model_config, num_params
from common.monitor import Monitor, memory, mfu, state_bytes


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """Parameter-server training on torch.distributed.rpc with a checkpointed server and auto-resume."""
    steps: int = 200  # total server updates of the job (a resumed job runs up to this)
    run_dir: str = "runs/rpc"  # holds ckpt/, metrics-rank<r>.jsonl and summary.json
    save_every: int = 50  # the server saves a checkpoint every N updates, and at the last one
    keep: int = 3  # committed checkpoints kept; older ones are deleted after each save
    seed: int = 0  # seeds the weights, the data and each trainer's per-step RNG
    device: str = "auto"  # where trainers compute: auto (a GPU per local rank if enough, else CPU), cpu or cuda
    preset: str = ""  # a named model shape (common.model.PRESETS: tiny ... 1b); replaces vocab, seq_len, dim, layers, heads
    vocab: int = 64  # vocabulary size (256 with --data)
    seq_len: int = 32  # tokens per sequence
    dim: int = 64  # model width
    layers: int = 2  # Transformer blocks
    heads: int = 4  # attention heads; must divide dim
    dropout: float = 0.0  # dropout; trainers reseed per step from (seed, step, rank), so resume stays exact
    tie_head: bool = False  # share the output head with the token embedding
    batch_size: int = 24  # global batch: sequences per update, split evenly across the trainers
    data: str = ""  # a text file to train on as bytes (vocab 256) instead of the synthetic task
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup: int = 20  # steps of linear warmup
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    log_every: int = 10  # print a log line every N steps
    timeout_s: int = 300  # RPC timeout: a hung server fails the trainers' calls instead of stalling them
    straggler_timeout: float = 30.0  # seconds the server waits for a trainer's gradient before dropping it
    crash_at_step: Optional[int] = None  # fault injection: --crash-rank dies right after step N, before saving
    crash_rank: int = -1  # the rank that --crash-at-step kills or --drop-trainer-at-step drops (-1: the last rank)
    crash_in_save: Optional[int] = None  # fault injection: the server dies mid-write of step N's checkpoint
    drop_trainer_at_step: Optional[int] = None  # fault injection: trainer --crash-rank leaves silently at step N


def check(cfg):
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        return [f"needs at least 2 processes (rank 0 is the server, the others are trainers), got {world}"]
    problems = common_problems(cfg, world - 1)  # the trainers split the batch
    if cfg.drop_trainer_at_step is not None and cfg.crash_rank % world == 0:
        problems.append(f"--drop-trainer-at-step drops the trainer --crash-rank, and rank 0 is the server: "
                        f"pick a rank in 1..{world - 1}")
    if not 0 < cfg.straggler_timeout < cfg.timeout_s:
        problems.append(f"--straggler-timeout must be > 0 and below --timeout-s {cfg.timeout_s} (a trainer may "
                        f"wait that long for its reply), got {cfg.straggler_timeout}")
    shape = newest_shape_problem(Path(cfg.run_dir) / "ckpt", cfg,  # the newest readable checkpoint must fit
                                 lambda p: torch.load(p, map_location="cpu", mmap=True, weights_only=True)["config"])
    return problems + [shape] if shape else problems


def lr_at(cfg, step):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- parameter server
class ParameterServer:
    """The model, the optimizer, the version (completed updates) and the live trainers, behind one lock.

    push() runs on RPC threads, one call per trainer and version; wait_until_done() on the main
    thread. Every read and write of the state happens under self.lock, and an update runs whole
    under it: gradients in, optimizer step, checkpoint, replies out."""

    def __init__(self, model, optimizer, scheduler, cfg, monitor, trainers, version, live, after_update):
        self.model, self.optimizer, self.scheduler, self.cfg, self.monitor = model, optimizer, scheduler, cfg, monitor
        self.tokens_per_trainer = cfg.batch_size // trainers * cfg.seq_len
        self.version, self.live = version, set(live)  # live: the trainer ranks an update waits for
        self.after_update = after_update  # after_update(step): fault injection and checkpoint, under the lock
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # wakes wait_until_done
        self.pushed = {}  # trainer rank -> (gradients, loss, future of its reply) for the current version
        self.version_started = self.waiting_since = time.monotonic()
        self.step_times, self.loss = [], None
        self.reply = self.snapshot()

    def snapshot(self):
        """(version, weights): a copy, so no reply in flight can see a later update's weights."""
        return self.version, {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def pull(self, trainer):
        with self.lock:
            return self.reply if trainer in self.live else None  # None: dropped earlier, stop

    def push(self, trainer, version, grads, loss):
        """A future of the reply to this push: (version, weights) after the next update, or None for a
        trainer that is no longer live."""
        future = torch.futures.Future()
        with self.lock:
            if trainer not in self.live:
                future.set_result(None)
            elif version != self.version:
                future.set_exception(ValueError(f"trainer {trainer} pushed for step {version}, "
                                                f"the server is at step {self.version}"))
            else:
                if not self.pushed:  # the first gradient of this version: the straggler clock starts
                    self.waiting_since = time.monotonic()
                    self.changed.notify_all()
                self.pushed[trainer] = (grads, loss, future)
                if self.live <= self.pushed.keys():
                    self.update()
        return future

    @staticmethod
    def pull_remote(trainer):
        return SERVER.pull(trainer)

    @staticmethod
    @rpc.functions.async_execution  # the RPC thread returns at once; the reply is sent when the future completes
    def push_remote(trainer, version, grads, loss):
        return SERVER.push(trainer, version, grads, loss)

    def update(self):
        """Average the pushed gradients in trainer order, step, save, answer. Called under the lock."""
        trainers = sorted(self.pushed)
        for i, p in enumerate(self.model.parameters()):
            p.grad = sum(self.pushed[t][0][i] for t in trainers) / len(trainers)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        self.loss = sum(self.pushed[t][1] for t in trainers) / len(trainers)
        dt = time.monotonic() - self.version_started
        self.step_times.append(dt)
        self.reply = self.snapshot()
        pushed_bytes = sum(g.numel() * g.element_size() for t in trainers for g in self.pushed[t][0])
        pulled_bytes = len(trainers) * sum(v.numel() * v.element_size() for v in self.reply[1].values())
        self.monitor.step(self.version, self.loss, lr, dt, self.tokens_per_trainer * len(trainers),
                          state_bytes(self.model, self.optimizer), updates_per_s=1 / dt,
                          bytes_moved=pushed_bytes + pulled_bytes, trainers=len(trainers))
        self.after_update(self.version)  # before any trainer sees the new version
        for t in trainers:
            self.pushed[t][2].set_result(self.reply)
        self.pushed = {}
        self.version_started = self.waiting_since = time.monotonic()
        self.changed.notify_all()

    def wait_until_done(self):
        """Main thread: return after the last update. A trainer whose gradient for the current version
        is still missing --straggler-timeout seconds after the first one arrived is dropped, and the
        update goes ahead without it. The clock starts at the first gradient, not at the version's
        start, so that a slow start (import, first step) is never taken for a lost trainer."""
        with self.lock:
            while self.version < self.cfg.steps:
                limit = self.cfg.straggler_timeout if self.pushed else self.cfg.timeout_s
                waited = time.monotonic() - self.waiting_since
                if waited < limit:
                    self.changed.wait(limit - waited)
                    continue
                if not self.pushed:
                    raise RuntimeError(f"no trainer pushed a gradient for step {self.version} in {waited:.0f} s")
                for t in sorted(self.live - self.pushed.keys()):
                    self.live.remove(t)
                    self.monitor.event("trainer_lost", step=self.version, trainer=t, waited_s=waited)
                    print(f"trainer {t} lost: no gradient for step {self.version} after {waited:.1f} s; "
                          f"continuing with {len(self.live)} trainers", flush=True)
                self.update()


SERVER = None  # the ParameterServer, on rank 0


def main(cfg):
    # ------------------------------------------------------------------------- setup
    # No process group: init_rpc is the rendezvous (MASTER_ADDR/PORT from torchrun, fresh each
    # restart) and rpc.shutdown() the final barrier; RPC is the only communication.
    global SERVER
    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")  # torch's own init_rpc
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cpu") if rank == 0 else pick_device(cfg.device, local_rank, local_world)
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=cfg.timeout_s)
    run_dir, ckpt_dir = Path(cfg.run_dir), Path(cfg.run_dir) / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print0(f"rpc: world size {world} (a server, {world - 1} trainers), restart {restarts()}")
    monitor = Monitor(run_dir, rank, device, cfg.log_every)
    crash_rank, trainers = cfg.crash_rank % world, world - 1

    # ------------------------------------------------------------------------- data
    data = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, cfg.data or None)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    # ------------------------------------------------------------------------- model and optimizer
    # The server's weights are the model; a trainer's copy is overwritten by every pull.
    model = Transformer(model_config(cfg), seed=cfg.seed).to(device)
    print0(f"model: {num_params(model):,} parameters")
    flops_per_step = 6 * num_params(model) * tokens_per_step / trainers  # model FLOPs of one trainer, for MFU

    if rank == 0:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(cfg, s) / cfg.lr)

        # --------------------------------------------------------------------- resume (server)
        # Done before init_rpc: the trainers' init_rpc returns only once the server is ready to answer.
        step, resumed_from, live = 0, None, range(1, world)
        _, path, state = load_newest(ckpt_dir, lambda p: torch.load(p, map_location="cpu", weights_only=True))
        if state is not None:
            t0 = time.perf_counter()
            if shape_mismatch(state["config"], cfg):
                fail(f"{path}: {shape_mismatch(state['config'], cfg)}; use another --run-dir")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step = resumed_from = state["step"]
            set_rng_state(state["rng"])
            if state["world_size"] == world:
                live = state["live"]
            else:  # other ranks: the saved live set names trainers that may not exist
                print0(f"world size changed from {state['world_size']} to {world}: all {trainers} trainers live")
            monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(path))
            print0(f"resuming from step {step}")
            del state
        elif checkpoints(ckpt_dir):  # never train fresh over checkpoints that exist but do not load
            fail(f"no checkpoint in {ckpt_dir} loads (see above); remove the damaged ones or use another --run-dir")
        else:
            seed_rng(cfg.seed, rank)
            print0("no checkpoint, starting fresh")
        monitor.event("start", resumed_from_step=resumed_from, restarts=restarts(), world_size=world)

        # --------------------------------------------------------------------- checkpoint (server)
        def after_update(step):
            """Under the server's lock, between the optimizer step and the replies: no update is half-done."""
            if cfg.crash_at_step == step and crash_rank == 0 and first_attempt():
                crash(f"server after step {step}")
            if step % cfg.save_every and step != cfg.steps:
                return
            t0 = time.perf_counter()
            die_mid_save = None
            if cfg.crash_in_save == step and first_attempt():
                die_mid_save = lambda: crash(f"server while saving step {step}")  # noqa: E731
            nbytes = atomic_save({
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "world_size": world,
                "rng": rng_state(), "config": dataclasses.asdict(cfg), "live": sorted(SERVER.live),
            }, ckpt_dir / step_name(step, ".pt"), before_commit=die_mid_save)
            prune(ckpt_dir, cfg.keep)
            save_s = time.perf_counter() - t0
            monitor.event("save", step=step, blocking_s=save_s, total_s=save_s, bytes=nbytes)
            print0(f"saved step {step} ({nbytes / 2**20:.1f} MiB, {save_s * 1000:.0f} ms)")

        # --------------------------------------------------------------------- serve
        SERVER = ParameterServer(model, optimizer, scheduler, cfg, monitor, trainers, step, live, after_update)
        rpc.init_rpc("server", rank=rank, world_size=world, rpc_backend_options=options)
        try:
            SERVER.wait_until_done()
        except BaseException:
            rpc.shutdown(graceful=False)  # fail fast; torchrun restarts the group
            raise
        step_times = SERVER.step_times
        summary = {
            "strategy": "rpc", "world_size": world, "steps": SERVER.version, "final_loss": SERVER.loss,
            "param_digest": param_digest(model.state_dict()), "resumed_from_step": resumed_from,
            "restarts": restarts(), "params": num_params(model), "state_bytes_per_rank": state_bytes(model, optimizer),
            "median_step_s": statistics.median(step_times) if step_times else None,
            "tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
            "trainers_lost": trainers - len(SERVER.live),
        }
        atomic_write_json(summary, run_dir / "summary.json")
        print0(f"done: step {SERVER.version}, final loss {summary['final_loss']}, "
               f"param_digest {summary['param_digest']}, trainers lost {summary['trainers_lost']}")
    else:
        # --------------------------------------------------------------------- train (trainers)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=options)
        monitor.event("start", restarts=restarts(), world_size=world)
        reply = rpc.rpc_sync("server", ParameterServer.pull_remote, args=(rank,))
        while reply is not None and reply[0] < cfg.steps:
            step, weights = reply
            if cfg.drop_trainer_at_step == step and rank == crash_rank and first_attempt():
                print(f"trainer {rank}: leaving silently at step {step} (--drop-trainer-at-step)", flush=True)
                break
            t0 = time.perf_counter()
            model.load_state_dict(weights)
            seed_rng(cfg.seed * 1_000_003 + step, rank)  # dropout randomness follows from the step, not from history
            inputs, targets = (t.to(device) for t in data.batch(step, rank - 1, trainers))
            model.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            grads = [p.grad.cpu() for p in model.parameters()]
            t1 = time.perf_counter()
            reply = rpc.rpc_async("server", ParameterServer.push_remote, args=(rank, step, grads, loss.item())).wait()
            t2 = time.perf_counter()
            if reply is None:
                break
            monitor.event("step", step=step + 1, loss=loss.item(), step_s=t2 - t0, compute_s=t1 - t0, wait_s=t2 - t1,
                          tokens_per_s=tokens_per_step / trainers / (t2 - t0), **memory(device),
                          mfu=mfu(flops_per_step, t2 - t0, device))
            if cfg.crash_at_step == step + 1 and rank == crash_rank and first_attempt():
                crash(f"trainer {rank} after step {step + 1}")
        if reply is None:
            print(f"trainer {rank}: dropped by the server, stopping", flush=True)

    # ------------------------------------------------------------------------- teardown
    # Graceful shutdown is a barrier over every process, a trainer that left early included: it
    # waits here, so no process exits while another still has an RPC in flight to it.
    t0 = time.perf_counter()
    rpc.shutdown()
    monitor.event("shutdown", shutdown_s=time.perf_counter() - t0)
    monitor.close()


if __name__ == "__main__":
    main(parse_config(Config, check))
    gc.freeze()  # exiting: spare Python's final collection over torch's objects (1.2 s of CPU a process here)
