"""DistributedDataParallel training that survives crashes: an atomic rank-0 checkpoint and auto-resume.

    bash run.sh ddp 4                                  # torchrun, 4 ranks, restarts on failure
    bash run.sh ddp 2 --steps 40 --save-every 10 --crash-at-step 25   # see a crash recovered
    bash run.sh ddp 2 --steps 40 --save-every 10 --async-save          # saves written while training goes on
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 ddp/train.py       # the variable makes restarts reliable (README)
    python ddp/train.py                                # one process, no torchrun

Every rank holds the whole model; gradients are all-reduced. Rank 0 saves the unwrapped model,
optimizer, step, config and every rank's RNG state into one file, atomically; every rank resumes
from the newest file that loads. Every step the node's ranks also copy the state into memory that
outlives a dead process (/dev/shm, common/snapshot.py): a restart resumes from there when it is newer,
and replays at most one step. Data and learning rate are functions of the step, so a crashed and
restarted job ends with exactly the weights of one that never crashed. A loss that is not finite
stops the job before it saves; checkpoints that do not load are moved aside, never deleted.
"""
import dataclasses
import contextlib
import functools
import json
import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` from anywhere in the repo
LAUNCHED_AT = time.time()  # this process's start, before torch is imported: where a restart's time splits

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import (FIRST_AUTO_SAVE, atomic_save, atomic_write_json, auto_save_every, checkpoints,
                               load_newest, lock_run_dir, newest_resume_problem, ownership_problems, param_digest,
                               prune, resume_problem, rng_state, run_dir_problems, seed_rng, set_rng_state,
                               step_name)
from common.config import (ANY_INT, AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, SECONDS, SEED, fail, flag_problems,
                           parse_config)
from common.data import StepData, data_problems
from common.dist import (PREEMPTED, StepGuard, agree, device_problems, exit_without_finalizing,
                         peer_loss_in_one_line, print0, restarts, set_collective_timeout, setup, teardown)
from common.faults import Faults
from common.model import (PRESETS, SHAPE_FIELDS, Transformer, model_config, model_problems, num_params,
                          num_params_of)
from common.monitor import (CommTimer, Monitor, eval_loss, mfu, peak_flops_problems, peak_since_reset, reset_peak,
                            state_bytes, training_summary)
from common import snapshot


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """DDP training with an atomic rank-0 checkpoint and auto-resume."""
    steps: int = 200  # total optimizer steps of the job (a resumed job runs up to this)
    run_dir: str = "runs/ddp"  # holds ckpt/, metrics-rank<r>.jsonl and summary.json
    save_every: int = 50  # save a checkpoint every N steps, and at the last step (0: N by Young and Daly's rule, see --mtbf-h)
    mtbf_h: float = 3.0  # --save-every 0: hours between the failures a disk save covers (3: about Llama 3's, 16k GPUs)
    keep: int = 3  # committed checkpoints kept; older ones are deleted after each save
    seed: int = 0  # seeds the weights, the data and each rank's RNG
    device: str = "auto"  # auto (a GPU per local rank if there are enough, else CPU), cpu or cuda
    preset: str = ""  # a named model shape (PRESETS in common/model.py: tiny ... 1b); replaces vocab, seq_len, dim, layers, heads
    vocab: int = 64  # vocabulary size: above every token id of --data (256 or more for a text file)
    seq_len: int = 32  # tokens per sequence
    dim: int = 64  # model width
    layers: int = 2  # Transformer blocks
    heads: int = 4  # attention heads; must divide dim
    dropout: float = 0.0  # dropout; its randomness is in the saved RNG state, so resume stays exact
    tie_head: bool = False  # share the output head with the token embedding
    batch_size: int = 24  # global batch: sequences per optimizer step, split evenly across ranks
    grad_accum: int = 1  # micro-batches each rank's rows are split into; the gradients are all-reduced after the last
    data: str = ""  # a token file (llm.c's or nanoGPT's *.bin) or a text file (bytes); default: the synthetic task
    val_data: str = ""  # a held-out token file for --eval-every (default: batches of --data no step draws)
    eval_every: int = 0  # every N steps, print the mean loss of --eval-batches fixed batches of --val-data (0: off)
    eval_batches: int = 4  # batches of --batch-size sequences per evaluation
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup: int = 20  # steps of linear warmup
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    log_every: int = 10  # print a log line every N steps
    timeout_s: int = 300  # collective timeout while starting, loading and saving: a hung peer fails the job
    hang_timeout_s: float = 15.0  # from step 5 on, a collective that waits longer than this (or 20 steps, if longer) fails
    bf16: bool = True  # on CUDA: autocast the forward to bf16; weights, gradients and their all-reduce stay fp32 (CPU: fp32)
    async_save: bool = False  # copy each checkpoint to CPU memory (pinned on CUDA), then write it in a background thread while training goes on
    snapshot_every: int = 1  # copy the state into --snapshot-dir every N steps (0: off): a restart loses at most N
    snapshot_dir: str = ""  # the node's folder for them, on a tmpfs (default: one for the run in /dev/shm)
    crash_at_step: Optional[int] = None  # fault injection: --crash-rank dies right after step N, before saving
    crash_rank: int = -1  # fault injection: the rank that --crash-at-step kills (-1: the last rank)
    crash_in_save: Optional[int] = None  # fault injection: rank 0 dies mid-write of step N's checkpoint
    crash_in_snapshot: Optional[int] = None  # fault injection: --crash-rank dies halfway through step N's snapshot
    nan_at_step: Optional[int] = None  # fault injection: the loss of step N is NaN, in every attempt (a diverged run)
    allow_changes: bool = False  # resume even if --seed, --batch-size or --data differ from the checkpoint's


# The valid values of the numeric flags above (common/config.py's rules; the model's are in common/model.py).
RANGES = {
    "steps": POSITIVE, "save_every": NON_NEGATIVE, "keep": POSITIVE, "seed": SEED, "batch_size": POSITIVE,
    "lr": POSITIVE, "min_lr": NON_NEGATIVE, "warmup": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
    "grad_clip": NON_NEGATIVE, "log_every": POSITIVE, "timeout_s": SECONDS,
    "mtbf_h": POSITIVE, "hang_timeout_s": SECONDS, "grad_accum": AT_LEAST_ONE, "eval_every": NON_NEGATIVE,
    "eval_batches": AT_LEAST_ONE, "snapshot_every": NON_NEGATIVE,
    "crash_at_step": POSITIVE, "crash_rank": ANY_INT, "crash_in_save": POSITIVE, "crash_in_snapshot": POSITIVE,
    "nan_at_step": POSITIVE,
}

# Settings a resume must keep: the model's shape (or the weights do not fit) and which samples a step sees.
SAMPLE_FIELDS = ("seed", "batch_size", "data")
SHARDED = False  # every rank holds the whole state: the memory tier keeps one copy of it per node


def check(cfg):
    """Every problem with the flags, the environment and the run folder, before training starts."""
    problems = (model_problems(cfg) + flag_problems(cfg, int(os.environ.get("WORLD_SIZE", 1)), RANGES) + device_problems(cfg.device)
                + peak_flops_problems() + run_dir_problems(cfg.run_dir) + ownership_problems(cfg.run_dir)
                + (data_problems(cfg.data, cfg.vocab, cfg.seq_len) if cfg.data else [])
                + (data_problems(cfg.val_data, cfg.vocab, cfg.seq_len, "--val-data") if cfg.val_data else []))
    resume = newest_resume_problem(Path(cfg.run_dir) / "ckpt", cfg,  # the newest readable checkpoint must fit
                                   lambda p: torch.load(p, map_location="cpu", mmap=True, weights_only=True),
                                   FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
    problems += [resume] if resume else []
    if not problems:  # room for the memory tier's slots
        problems += snapshot.tier_problems(cfg, num_params_of(cfg), sharded=SHARDED)
    return problems


def lr_at(cfg, step):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def forward_backward(ddp_model, micro_batches, device, bf16, poison):
    """Forward and backward of one step's micro-batches (--grad-accum); returns the step's loss, their mean.
    Gradients add up on each rank; only the last micro-batch's backward all-reduces them."""
    loss = 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                micro = ddp_model(inputs.to(device), targets.to(device))
            micro = poison(micro) / len(micro_batches)
            micro.backward()
        loss = loss + micro.detach()
    return loss


# ----------------------------------------------------------------------------- checkpoint
# The layout of ckpt/step-NNNNNNNN.pt (save() writes it, resume() reads it): a load refuses any other.
FORMAT = 2


@dataclass
class Run:
    """What the checkpoint needs of this job, fixed from setup to teardown."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    ckpt_dir: Path
    monitor: Monitor
    faults: Faults  # the tests' faults, idle unless a fault flag is set (common/faults.py)
    write_pool: Optional[ThreadPoolExecutor]  # --async-save: the one thread that writes rank 0's checkpoints
    snapshots: Optional[snapshot.Snapshots]  # the memory tier (common/snapshot.py); None if it is off


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


@dataclass
class PendingSave:
    """A checkpoint being saved. blocking_s is what the training loop waited for it: all of a synchronous
    save; for an async one the CPU copy (staging_s), then the wait for its write before the next save (not
    the wait at the end of the job: no step is left to stall). `future` is rank 0's write in its thread."""
    step: int
    t0: float
    blocking_s: float = 0.0
    staging_s: Optional[float] = None
    done_at: Optional[float] = None
    future: Optional[Future] = None


def save(run, step, model, optimizer, asynchronous):
    """Rank 0 writes everything a bitwise resume needs into one file, committed by its rename; every rank
    sends it its RNG. Returns the PendingSave, still being written if asynchronous; else finished (None).

    An async save copies the state into CPU memory on the main thread (pinned on CUDA: a fast copy from
    the GPU), after which training may change the weights; run.write_pool then writes, fsyncs and renames
    the file. One save is in flight at a time: the next one, and the end of the job, wait for it first."""
    t0 = time.perf_counter()
    rngs = [None] * run.world
    dist.all_gather_object(rngs, rng_state())  # every rank's RNG, saved by rank 0
    pending = PendingSave(step, t0)
    if run.rank == 0:
        before_commit = run.faults.in_save(step)
        state = {"format": FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step, "world_size": run.world, "rng": rngs, "config": dataclasses.asdict(run.cfg)}
        path = run.ckpt_dir / step_name(step, ".pt")
        if asynchronous:
            pin = run.device.type == "cuda"
            state = cpu_copy(state, pin)
            if pin:
                torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
            pending.staging_s = time.perf_counter() - t0
            pending.future = run.write_pool.submit(atomic_save, state, path, before_commit=before_commit)
            pending.future.add_done_callback(lambda _: setattr(pending, "done_at", time.perf_counter()))
        else:
            pending.future = Future()  # done already: finish_save reports it like an async one
            try:
                pending.future.set_result(atomic_save(state, path, before_commit=before_commit))
            except Exception as e:  # a full disk: the previous checkpoints stay as they are
                pending.future.set_exception(e)
    pending.blocking_s = time.perf_counter() - t0
    if run.rank != 0 and asynchronous:  # nothing of it is in flight on this rank
        pending.done_at = t0 + pending.blocking_s
    return pending if asynchronous else finish_save(run, pending)


def finish_save(run, pending, in_loop=True):
    """Wait for rank 0's write (in the loop, the wait blocks training); the ranks then agree on its
    outcome, so that all of them stop after a failed write (one line and exit 3: the checkpoints of
    earlier steps stay the ones a restart loads), and none runs ahead of an unfinished save. Returns None:
    no save is pending any more."""
    t0, nbytes, error = time.perf_counter(), 0, None
    if pending.future is not None:
        try:
            nbytes = pending.future.result()
        except Exception as e:
            error = e
    if not agree(error is None, run.device):
        fail(f"saving step {pending.step} failed ({getattr(error, 'strerror', None) or error}): the checkpoints "
             "of earlier steps are kept" if run.rank == 0 else None, code=3)
    if run.rank == 0:
        prune(run.ckpt_dir, run.cfg.keep, pending.step)
    now = time.perf_counter()
    pending.blocking_s += now - t0 if in_loop else 0.0
    total_s = (pending.done_at or now) - pending.t0  # its callback may run after result()
    run.monitor.event("save", step=pending.step, blocking_s=pending.blocking_s, staging_s=pending.staging_s,
                      total_s=total_s, bytes=nbytes)
    print0(f"saved step {pending.step} ({nbytes / 2**20:.1f} MiB, blocking {pending.blocking_s * 1000:.0f} ms,"
           + (f" copied in {pending.staging_s * 1000:.0f} ms," if pending.staging_s is not None else "")
           + f" total {total_s * 1000:.0f} ms)")
    return None


def read_checkpoint(path):
    """A checkpoint file as save() wrote it, its tensors on the CPU (load_state_dict moves them)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def resume(run, model, optimizer, fused):
    """Restore the model, the optimizer and this rank's RNG from the newest checkpoint that loads, or seed
    the RNG for a fresh start. Returns (the step to go on from, the step resumed from or None).

    Rank 0 picks the checkpoint (falling back past torn ones) and every rank loads that same file, so no
    rank can resume from another step than the others."""
    cfg, rank, world = run.cfg, run.rank, run.world
    if run.snapshots:  # the memory tier first: a snapshot newer than the newest disk checkpoint loses less
        t0, committed = time.perf_counter(), checkpoints(run.ckpt_dir) if rank == 0 else None
        step = snapshot.resume_from_memory(
            run.snapshots, committed[0][0] if committed else None, model, optimizer, run.device,
            lambda record: resume_problem(record, cfg, snapshot.FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)[0])
        if step is not None:
            run.monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(run.snapshots.folder),
                              source="memory")
            print0(f"resuming from step {step} (memory snapshot)")
            return step, step
    chosen, state, t0 = [None], None, time.perf_counter()
    if rank == 0:
        _, chosen[0], state = load_newest(run.ckpt_dir, read_checkpoint)
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        if checkpoints(run.ckpt_dir):  # never train fresh over checkpoints that exist but do not load
            fail(f"no checkpoint in {run.ckpt_dir} loads (see above); remove the damaged ones or use another --run-dir")
        seed_rng(cfg.seed, rank)
        print0("no checkpoint, starting fresh")
        return 0, None
    if state is None:
        state = read_checkpoint(chosen[0])
    problem, changes = resume_problem(state, cfg, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS, cfg.allow_changes)
    if problem:
        fail(f"{chosen[0]}: {problem}")
    if changes:
        print0(f"resuming with changed settings: {', '.join(changes)}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:  # the loaded groups carry the saving run's choice
        group["fused"] = fused
    step = state["step"]
    if state["world_size"] == world:
        set_rng_state(state["rng"][rank])
    else:  # each rank's RNG stream cannot carry over to another world size: derive new ones
        seed_rng(cfg.seed + step, rank)
        print0(f"world size changed from {state['world_size']} to {world}: per-rank RNG re-derived")
    run.monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(chosen[0]), source="disk")
    print0(f"resuming from step {step}")
    return step, step


def main(cfg):
    # ------------------------------------------------------------------------- setup
    rank, world, device = setup(cfg.device, cfg.timeout_s)
    try:
        run_dir, ckpt_dir = Path(cfg.run_dir), Path(cfg.run_dir) / "ckpt"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # Rank 0 holds the run folder's lock until it exits: a second job would prune this one's checkpoints.
        lock = lock_run_dir(run_dir) if rank == 0 else True
        if lock is None:
            fail(f"--run-dir {run_dir} is in use by another job (see its .lock); use another --run-dir")
        print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
        print0(f"ddp: world size {world}, device {device}, restart {restarts()}")
        monitor = Monitor(run_dir, rank, device, cfg.log_every)
        faults = Faults(cfg, rank, world)  # the tests' faults, idle unless a fault flag is set (common/faults.py)
        write_pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer") if cfg.async_save
                      else None)
        # The memory tier (common/snapshot.py): every rank's RNG, and one copy per node of the model and
        # optimizer, which the node's ranks (numbered in a row by torchrun) copy a part each; each rank's
        # record also goes to a rank of the next node, so that a replaced node resumes from memory too.
        first = rank - int(os.environ.get("LOCAL_RANK", 0))
        snapshots = snapshot.open_tier(cfg, ckpt_dir, range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", 1))),
                                       replicate="records")
        run = Run(cfg, rank, world, device, ckpt_dir, monitor, faults, write_pool, snapshots)

        # --------------------------------------------------------------------- data
        data = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, cfg.data or None)
        print0(f"data: {data.format}" + (f", {cfg.grad_accum} micro-batches a step" if cfg.grad_accum > 1 else ""))
        tokens_per_step = cfg.batch_size * cfg.seq_len
        val_batches = []  # --eval-every: the same held-out batches at every evaluation
        if cfg.eval_every:
            val = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, cfg.val_data or cfg.data or None)
            val_batches = val.held_out(cfg.eval_batches, rank, world)
            print0(f"eval: every {cfg.eval_every} steps, {cfg.eval_batches} batches of {val.format}")

        # --------------------------------------------------------------------- model and optimizer
        baseline = reset_peak(device)
        model = Transformer(model_config(cfg), seed=cfg.seed).to(device)
        # Peak memory of construction above what the process held before it: the whole model, on every rank.
        monitor.event("built", baseline_bytes=baseline, peak_bytes=peak_since_reset(device),
                      full_model_bytes=4 * num_params(model))
        # Fused AdamW (one kernel for all parameters) on the GPU; the CPU keeps the default, whose weights
        # the DDP and FSDP digests are compared on.
        fused = True if device.type == "cuda" else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
        bf16 = cfg.bf16 and device.type == "cuda"
        flops_per_step = 6 * num_params(model) * tokens_per_step / world  # model FLOPs of one rank, for MFU
        print0(f"model: {num_params(model):,} parameters, {'bf16' if bf16 else 'fp32'} compute"
               f"{', fused AdamW' if fused else ''}")

        # --------------------------------------------------------------------- resume
        step, resumed_from = resume(run, model, optimizer, fused)
        monitor.event("start", launched_at=LAUNCHED_AT, resumed_from_step=resumed_from, restarts=restarts(),
                      world_size=world)

        # DDP regroups its all-reduce buckets after the first step, in the order gradients became ready.
        # A resumed job would run its first step on the initial buckets, and with more than 2 ranks the
        # sums then add up in another order (seen here: other weights at 4 ranks). With
        # find_unused_parameters the initial buckets stay for good, at the cost of one graph traversal
        # per step (and a one-time warning that no parameter was unused).
        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        find_unused_parameters=True)
        comm = CommTimer()
        ddp_model.register_comm_hook(None, comm.hook)
        if cfg.async_save:
            print0(f"async save: copied on the main thread into {'pinned' if device.type == 'cuda' else 'pageable'}"
                   " CPU memory, written in a background thread")
        guard = StepGuard(device, cfg.timeout_s, cfg.hang_timeout_s)  # SIGTERM and hangs: see common.dist

        # --------------------------------------------------------------------- training loop
        step_times, pending = [], None
        save_every = cfg.save_every or FIRST_AUTO_SAVE  # --save-every 0: a first save measures the cost
        snapshot_s = 0.0  # the loop's time blocked by the last snapshot: its start, then the wait for its copy
        while step < cfg.steps:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(ddp_model, data.micro_batches(step, rank, world, cfg.grad_accum), device, bf16,
                                    lambda micro: faults.poison_loss(micro, step))
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            lr = lr_at(cfg, step)  # a function of the step: a resume, even with a new --lr, needs no saved schedule
            for group in optimizer.param_groups:
                group["lr"] = lr
            if snapshots:  # the optimizer must not change tensors a snapshot is still copying
                snapshot_s += snapshots.wait()
            optimizer.step()
            step += 1
            mean_loss, stop = guard.agree(loss)  # the loss over all ranks, and whether any rank was signalled
            if not math.isfinite(mean_loss):  # diverged: every rank stops here, before anything is saved
                if pending:  # an earlier step's save, of finite weights: let it commit
                    finish_save(run, pending, in_loop=False)
                fail(f"loss is {mean_loss} at step {step}: stopping without saving, the checkpoints of earlier "
                     "steps are kept", code=3)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            saving = pending is not None and (pending.done_at or math.inf) > t0  # rank 0's async write was in flight
            monitor.step(step, mean_loss, lr, dt, tokens_per_step, state_bytes(model, optimizer), comm_s=comm.pop(),
                         mfu=mfu(flops_per_step, dt, device), saving=saving, snapshot_s=snapshot_s)

            guard.shorten_timeout(step_times)
            faults.after_step(step)
            if cfg.eval_every and step % cfg.eval_every == 0:  # draws no random number: training goes on as without it
                monitor.evaluation(step, *eval_loss(model, val_batches, device, bf16))

            # ----------------------------------------------------------------- checkpoint
            if snapshots and snapshots.due(step):  # copied in a thread while the next step computes
                snapshot_s = snapshots.start(step, functools.partial(get_state_dict, model, optimizer), rng_state(),
                                             faults.in_snapshot(step))
            if step % save_every == 0 or step == cfg.steps or stop:
                t_save = time.perf_counter()
                with guard.patient():  # the other ranks may wait while rank 0 writes or prunes
                    if pending:  # one save in flight at a time: the previous one commits first
                        pending = finish_save(run, pending)
                    pending = save(run, step, model, optimizer, asynchronous=cfg.async_save and not stop)
                if not cfg.save_every:  # the interval from what this save cost the loop
                    save_every = auto_save_every(time.perf_counter() - t_save, step_times, cfg, device)
            if stop and step < cfg.steps:  # saved: exit non-zero, so that torchrun (or the scheduler) restarts the job
                monitor.event("preempted", step=step, signalled_at=guard.signalled_at)
                print0(f"preempted (SIGTERM or SIGUSR1): step {step} saved, exiting for a restart")
                raise SystemExit(PREEMPTED)

        # --------------------------------------------------------------------- teardown
        set_collective_timeout(cfg.timeout_s)
        if pending:
            finish_save(run, pending, in_loop=False)
        if write_pool:
            write_pool.shutdown()
        if snapshots:  # the last step is on disk: the memory tier has nothing more to offer
            snapshots.remove()
        if rank == 0:
            summary = training_summary(
                device, step_times, tokens_per_step, flops_per_step, strategy="ddp", world_size=world, steps=step,
                final_loss=mean_loss if step_times else None, param_digest=param_digest(model.state_dict()),
                resumed_from_step=resumed_from, restarts=restarts(), params=num_params(model),
                state_bytes_per_rank=state_bytes(model, optimizer), async_save=cfg.async_save,
                snapshot_bytes=snapshots.nbytes if snapshots else None)
            atomic_write_json(summary, run_dir / "summary.json")
            print0(f"done: step {step}, final loss {summary['final_loss']}, param_digest {summary['param_digest']}")
        monitor.close()
    finally:
        teardown()


if __name__ == "__main__":
    cfg = parse_config(Config, check, presets=PRESETS)
    with peer_loss_in_one_line(cfg.run_dir):  # a crashed peer: one line here, the traceback in a file
        main(cfg)
    exit_without_finalizing()  # gloo may abort the process in the interpreter's finalization: see common.dist
