"""FSDP2 training that survives crashes: sharded weights, a distributed checkpoint (DCP) written by
every rank, auto-resume at the same or another world size, and optional async save.

    bash run.sh fsdp 4                                 # torchrun, 4 ranks, restarts on failure
    bash run.sh fsdp 4 --steps 40 --save-every 10 --crash-at-step 25   # see a crash recovered
    bash run.sh fsdp 2 --steps 40 --save-every 10 --async-save         # saves overlap training
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 fsdp/train.py      # the variable makes restarts reliable (README)
    python fsdp/train.py --export model.pt             # one process; write the final weights as one file

Each rank holds 1/world of the parameters, gradients and optimizer state (fully_shard per block,
then the root). A checkpoint is a folder ckpt/step-NNNNNNNN/: every rank writes its own shards, then
rank 0 adds train.pt (step, config, every rank's RNG) and DCP's `.metadata` last, which commits it
(fsdp/saving.py). Every step each rank also copies its shards into memory that outlives a dead
process (/dev/shm, common/snapshot.py). Resume takes the newest snapshot that every rank holds whole,
if it is newer than the disk's, replaying at most one step; else the newest committed folder that
loads on every rank (each is tried twice), resharded to the current world size, with the same global
batch. Newer folders that did not load are moved aside, never deleted. A loss that is not finite
stops the job unsaved.
"""
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` from anywhere in the repo
LAUNCHED_AT = time.time()  # this process's start, before torch is imported: where a restart's time splits

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.checkpoint import (FIRST_AUTO_SAVE, atomic_save, atomic_write_json, auto_save_every, checkpoints,
                               fsync_dir, lock_run_dir, move_aside, newest_resume_problem, ownership_problems,
                               param_digest, prune, remove, resume_problem, rng_state, run_dir_problems, seed_rng,
                               set_rng_state, step_name)
from common.config import (ANY_INT, AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, SECONDS, SEED, fail, flag_problems,
                           parse_config)
from common.data import StepData, data_problems
from common.dist import (PREEMPTED, StepGuard, device_problems, exit_without_finalizing, peer_loss_in_one_line,
                         print0, restarts, set_collective_timeout, setup, teardown)
from common.faults import Faults
from common.model import (PRESETS, SHAPE_FIELDS, Transformer, model_config, model_problems, num_params,
                          num_params_of)
from common.monitor import (Monitor, eval_loss, mfu, peak_flops_problems, peak_since_reset, reset_peak, state_bytes,
                            training_summary)
from common import snapshot
from fsdp.saving import (FORMAT, REUSE_STAGER, ShardedSave, Writer, describe_staging, load_newest_everywhere,
                         save_failed, staging_options)


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """FSDP2 training with a sharded distributed checkpoint, auto-resume and resharding."""
    steps: int = 200  # total optimizer steps of the job (a resumed job runs up to this)
    run_dir: str = "runs/fsdp"  # holds ckpt/, metrics-rank<r>.jsonl and summary.json
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
    grad_accum: int = 1  # micro-batches each rank's rows are split into; the gradients are reduce-scattered after the last
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
    bf16: bool = True  # on CUDA: bf16 compute weights, fp32 gradient reduction and fp32 master weights (CPU: fp32)
    reshard_after_forward: bool = True  # free each block's gathered weights after forward; gather again for backward
    cpu_offload: bool = False  # keep parameters, gradients and optimizer state in CPU memory between uses (FSDP2's CPUOffloadPolicy)
    async_save: bool = False  # copy each checkpoint to CPU buffers and write it in background threads while training goes on
    snapshot_every: int = 1  # copy the shards into --snapshot-dir every N steps (0: off): a restart loses at most N
    snapshot_dir: str = ""  # the node's folder for them, on a tmpfs (default: one for the run in /dev/shm)
    save_threads: int = 8  # threads writing each rank's shards (on an H200's disk: 1 -> 0.58, 8 -> 0.88 of a raw write)
    compile: bool = False  # torch.compile each block before sharding it (as torchtitan does); the first steps compile
    export: str = ""  # at the end, torch.save the full model state dict to this file (for common.model.Transformer)
    crash_at_step: Optional[int] = None  # fault injection: --crash-rank dies right after step N, before saving
    crash_rank: int = -1  # fault injection: the rank that --crash-at-step kills (-1: the last rank)
    crash_in_save: Optional[int] = None  # fault injection: rank 0 dies saving step N, shards written, before the commit
    crash_in_staging: Optional[int] = None  # fault injection: --crash-rank dies while the async save of step N copies its shards
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
    "nan_at_step": POSITIVE, "crash_in_staging": POSITIVE, "save_threads": POSITIVE,
}

# Settings a resume must keep: the model's shape (or the weights do not fit) and which samples a step sees.
SAMPLE_FIELDS = ("seed", "batch_size", "data")
SHARDED = True  # each rank holds 1/world of the state: so does its memory tier


def check(cfg):
    """Every problem with the flags, the environment and the run folder, before training starts."""
    problems = (model_problems(cfg) + flag_problems(cfg, int(os.environ.get("WORLD_SIZE", 1)), RANGES) + device_problems(cfg.device)
                + peak_flops_problems() + run_dir_problems(cfg.run_dir, cfg.export)
                + ownership_problems(cfg.run_dir)
                + (data_problems(cfg.data, cfg.vocab, cfg.seq_len) if cfg.data else [])
                + (data_problems(cfg.val_data, cfg.vocab, cfg.seq_len, "--val-data") if cfg.val_data else []))
    resume = newest_resume_problem(Path(cfg.run_dir) / "ckpt", cfg,  # the newest readable checkpoint must fit
                                   lambda p: torch.load(p / "train.pt", map_location="cpu", weights_only=True),
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


# ----------------------------------------------------------------------------- model
def scatter_from_rank0(model, full):
    """Give every rank its shard of each parameter of `full`, the seeded model that rank 0 holds: FSDP
    shards dim 0 as torch.chunk does, so rank r gets rows [r*n, (r+1)*n) with n = ceil(rows / world).
    Rank 0 pads each tensor to world*n rows so that the chunks are equal, as scatter needs; the other
    ranks receive only a shard's bytes, never a full tensor. Buffers are not sharded: rank 0 sends each
    whole, persistent or not (to_empty left them uninitialised; a rotary embedding's table, say)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = dict(full.named_parameters()) if rank == 0 else {}
    for name, param in model.named_parameters():  # DTensors: the local shard and the global shape
        local, rows = param.to_local(), -(-param.shape[0] // world)
        shard = torch.empty((rows, *param.shape[1:]), dtype=param.dtype, device=local.device)
        chunks = None
        if rank == 0:
            padded = torch.zeros((rows * world, *param.shape[1:]), dtype=param.dtype, device=local.device)
            padded[:param.shape[0]] = params[name].detach()
            chunks = list(padded.chunk(world))
        dist.scatter(shard, chunks, src=0)
        with torch.no_grad():
            local.copy_(shard[:local.shape[0]])
    buffers = dict(full.named_buffers()) if rank == 0 else {}
    for name, buffer in model.named_buffers():
        if rank == 0:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)


def build_model(cfg, mesh, device, bf16, monitor):
    """The Transformer of `cfg`, sharded over `mesh`. It is built on the meta device (shapes, no memory),
    sharded, and only then given memory: each rank allocates its own shards, never the whole model. Rank 0
    builds the seeded weights on the CPU and sends every rank its shards, so they are exactly the weights
    `Transformer(seed)` has everywhere else (DDP's included)."""
    with torch.device("meta"):
        model = Transformer(model_config(cfg), seed=cfg.seed)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    # With --cpu-offload the shards, their gradients and the optimizer state live in CPU memory, and
    # each block's parameters visit the device only for its forward and backward.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    for block in model.blocks:
        if cfg.compile:  # in place, so the state dict keeps its keys (torch.compile(block) would prefix them)
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)  # the root: embeddings, final norm, head
    baseline = reset_peak(device)  # sharding meta tensors allocated nothing of the model
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    scatter_from_rank0(model, Transformer(model_config(cfg), seed=cfg.seed) if dist.get_rank() == 0 else None)
    # Peak memory of construction above what the process held before it: shards, plus on rank 0 the full CPU copy.
    monitor.event("built", baseline_bytes=baseline, peak_bytes=peak_since_reset(device),
                  full_model_bytes=4 * num_params(model))
    return model


def forward_backward(model, micro_batches, device, poison):
    """Forward and backward of one step's micro-batches (--grad-accum); returns the step's loss, their mean.
    Gradients add up unsharded on each rank; the last backward reduce-scatters them, and each rank ends
    with the mean gradient of its shard. With micro-batches the gathered weights stay from the first
    forward to the last backward: one all-gather a step, not two a micro-batch (1.08x the step time of
    one batch, 2 ranks, CPU, K=4, median of 5, against 2x), at the memory of the unsharded weights and
    gradients, as a DDP rank holds them."""
    k, loss = len(micro_batches), 0.0
    if k > 1:
        model.set_reshard_after_forward(False)
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == k - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last or k == 1)
        micro = poison(model(inputs.to(device), targets.to(device))) / k
        micro.backward()
        loss = loss + micro.detach()
    return loss


# ----------------------------------------------------------------------------- checkpoint
# A checkpoint is a folder ckpt/step-NNNNNNNN/ holding every rank's shards of "model" and "optimizer"
# (DCP, by name, as get_state_dict gives them) and train.pt (format, step, world_size, config, rng). save()
# builds it, fsdp/saving.py's Writer writes and commits it; resume() reads it back.
@dataclass
class Run:
    """What every save of this run uses, fixed once the run has resumed.

    An async save copies this rank's shards into CPU buffers (staging), then writes them, both in threads
    (fsdp/saving.py): the loop waits for the copy only before its next optimizer step, which would change
    the weights being copied. Where the torch version allows, one stager keeps its buffers for the run and
    copies into them again at each save; else each save gets a fresh one."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    ckpt_dir: Path
    monitor: Monitor
    faults: Faults
    save_group: Optional[dist.ProcessGroup]  # the async saves' own group; None without --async-save
    staging: StagingOptions  # how an async save copies the shards (fsdp/saving.py)
    stager: Optional[DefaultStager]  # the one stager every async save reuses, where the torch version allows


def save(run, step, model, optimizer, asynchronous):
    """Start the checkpoint of `step`: every rank's shards through DCP, then rank 0's train.pt and DCP's
    `.metadata`, which commits it. Returns the ShardedSave still in flight if asynchronous, else None:
    a synchronous save is finished (finish_save) before it returns."""
    t0 = time.perf_counter()
    path = run.ckpt_dir / step_name(step)
    # The Writer adds "rng", every rank's RNG state, gathered in the thread that saves.
    train_pt = {"format": FORMAT, "step": step, "world_size": run.world, "config": dataclasses.asdict(run.cfg)}
    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))  # this rank's shards, by name
    writer = Writer(path, train_pt, rng_state(), run.save_group if asynchronous else None, run.cfg.save_threads,
                    before_commit=run.faults.in_save(step, f" into {path}: shards written, not committed"))
    record = ShardedSave(step, path, t0)
    if asynchronous:  # returns at once: the copy and the write go on in threads
        # The side stream does not wait for the training stream: this step's weights must be final.
        if run.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        record.stager = run.faults.stager(run.staging, step) or run.stager or DefaultStager(run.staging)
        response = dcp.async_save(state, storage_writer=writer, process_group=run.save_group,
                                  async_stager=record.stager)  # an AsyncSaveResponse: staging is async
        record.staging, record.future = response.staging_completion, response.upload_completion
        record.staging.add_done_callback(lambda _: setattr(record, "staged_at", time.perf_counter()))
        record.future.add_done_callback(lambda _: setattr(record, "done_at", time.perf_counter()))
        record.blocking_s = time.perf_counter() - t0
        return record
    try:  # returns once every rank's shards and the commit are on disk
        dcp.save(state, storage_writer=writer)
    except (Exception, CheckpointException) as e:  # a full disk: the folder stays uncommitted, never loaded
        save_failed(step, e)
    record.done_at = time.perf_counter()
    record.blocking_s = record.done_at - t0
    finish_save(run, record)
    return None


def finish_save(run, record, in_loop=True):
    """Wait for the save `record` to commit (in the loop, the wait blocks training), then make it durable,
    prune and report it."""
    record.wait_committed(in_loop, run.stager)
    nbytes = 0
    if run.rank == 0:  # the commit reaches the disk before older checkpoints are deleted
        fsync_dir(record.path)
        fsync_dir(run.ckpt_dir)
        nbytes = sum(f.stat().st_size for f in record.path.iterdir())
        prune(run.ckpt_dir, run.cfg.keep, record.step)
    total_s = (record.done_at or time.perf_counter()) - record.t0  # its callback may run after result()
    staging_s = record.staging_s()
    run.monitor.event("save", step=record.step, blocking_s=record.blocking_s, staging_s=staging_s, total_s=total_s,
                      bytes=nbytes, staging_wait_s=record.staging_wait_s, commit_wait_s=record.commit_wait_s)
    print0(f"saved step {record.step} ({nbytes / 2**20:.1f} MiB, blocking {record.blocking_s * 1000:.0f} ms,"
           + (f" staged in {staging_s * 1000:.0f} ms," if staging_s is not None else "")
           + f" total {total_s * 1000:.0f} ms)")


def resume(cfg, ckpt_dir, snapshots, model, optimizer, fused, device, monitor):
    """Restore the newest memory snapshot that every rank holds, if it is newer than the disk's newest
    checkpoint; else load the newest checkpoint of `ckpt_dir` that loads on every rank and fits `cfg`, and
    restore train.pt's step and RNG states; else start fresh. Returns (step, the step resumed from or None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if snapshots:  # a snapshot newer than the newest disk checkpoint loses less
        t0, committed = time.perf_counter(), checkpoints(ckpt_dir) if rank == 0 else None
        step = snapshot.resume_from_memory(
            snapshots, committed[0][0] if committed else None, model, optimizer, device,
            lambda record: resume_problem(record, cfg, snapshot.FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)[0])
        if step is not None:
            monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(snapshots.folder),
                          source="memory")
            print0(f"resuming from step {step} (memory snapshot)")
            return step, step
    # Rank 0 lists the committed checkpoints, newest first, for everyone; all ranks try each in
    # turn and move on together, so they never load different steps.
    candidates = [[path for _, path in checkpoints(ckpt_dir)] if rank == 0 else None]
    dist.broadcast_object_list(candidates, src=0)
    path, train_pt, load_s, unreadable = load_newest_everywhere(candidates[0], model, optimizer, device, monitor)
    step, resumed_from = 0, None
    if candidates[0] and train_pt is None:  # never train fresh over checkpoints that exist but do not load
        fail(f"no checkpoint in {ckpt_dir} loads (see above); move the damaged ones away or use another --run-dir")
    if train_pt is not None:
        problem, changes = resume_problem(train_pt, cfg, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS, cfg.allow_changes)
        if problem:
            fail(f"{path}: {problem}")
        if changes:
            print0(f"resuming with changed settings: {', '.join(changes)}")
        step = resumed_from = train_pt["step"]
        if train_pt["world_size"] == world:
            set_rng_state(train_pt["rng"][rank])
        else:  # each rank's RNG stream cannot carry over to another world size: derive new ones
            seed_rng(cfg.seed + step, rank)
            print0(f"resharded from {train_pt['world_size']} to {world} ranks")
            monitor.event("reshard", step=step, from_world_size=train_pt["world_size"], world_size=world)
        for group in optimizer.param_groups:  # the loaded groups carry the saving run's choice
            group["fused"] = fused
        monitor.event("load", step=step, load_s=load_s, path=str(path), source="disk")
        print0(f"resuming from step {step}")
    else:
        seed_rng(cfg.seed, rank)
        print0("no checkpoint, starting fresh")
    # The steps of newer folders will be trained and saved again, into fresh folders (a committed
    # one is never overwritten in place): move the unreadable ones aside, and remove torn saves.
    if rank == 0:
        for p in unreadable:
            move_aside(p, "did not load on every rank")
        for _, p in checkpoints(ckpt_dir, committed=False):
            if remove(p):
                print(f"removed {p.name} (never committed)", flush=True)
    return step, resumed_from


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
        print0(f"fsdp: world size {world}, device {device}, restart {restarts()}")
        monitor = Monitor(run_dir, rank, device, cfg.log_every)
        faults = Faults(cfg, rank, world)  # the tests' faults, idle unless a fault flag is set (common/faults.py)
        # The mesh over the world group, so FSDP's collectives have its timeout (init_device_mesh would
        # make a group of its own, with gloo's 30-minute default where CUDA is visible but unused).
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        # Async saves run their collectives in a background thread: a group of their own (gloo, as
        # DCP needs a CPU backend for it) keeps them from interleaving with the training collectives.
        save_group = None
        if cfg.async_save:
            save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))

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
        bf16 = cfg.bf16 and device.type == "cuda"
        model = build_model(cfg, mesh, device, bf16, monitor)
        # Fused AdamW (one kernel for all parameters) where they live on the GPU; the CPU keeps the default,
        # whose weights the DDP and FSDP digests are compared on.
        fused = True if device.type == "cuda" and not cfg.cpu_offload else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
        flops_per_step = 6 * num_params(model) * tokens_per_step / world  # model FLOPs of one rank, for MFU
        print0(f"model: {num_params(model):,} parameters, {'bf16' if bf16 else 'fp32'} compute, sharded over {world}"
               f" ranks{', blocks compiled' if cfg.compile else ''}{', fused AdamW' if fused else ''}")

        # --------------------------------------------------------------------- resume
        # The memory tier: a rank's shards and RNG, also kept by a rank of the next node (common/snapshot.py)
        snapshots = snapshot.open_tier(cfg, ckpt_dir, range(rank, rank + 1), replicate="shards")
        step, resumed_from = resume(cfg, ckpt_dir, snapshots, model, optimizer, fused, device, monitor)
        monitor.event("start", launched_at=LAUNCHED_AT, resumed_from_step=resumed_from, restarts=restarts(),
                      world_size=world)

        cuda = device.type == "cuda"
        staging = staging_options(cuda)
        stager = DefaultStager(staging) if cfg.async_save and REUSE_STAGER else None  # one for the run: see Run
        if cfg.async_save:
            print0(describe_staging(cuda))
        run = Run(cfg, rank, world, device, ckpt_dir, monitor, faults, save_group, staging, stager)
        guard = StepGuard(device, cfg.timeout_s, cfg.hang_timeout_s)  # SIGTERM and hangs: see common.dist

        # --------------------------------------------------------------------- training loop
        step_times, pending = [], None  # pending: the async save in flight, if any
        save_every = cfg.save_every or FIRST_AUTO_SAVE  # --save-every 0: a first save measures the cost
        snapshot_s = 0.0  # the loop's time blocked by the last snapshot: its start, then the wait for its copy
        while step < cfg.steps:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(model, data.micro_batches(step, rank, world, cfg.grad_accum), device,
                                    lambda micro: faults.poison_loss(micro, step))
            if cfg.grad_clip > 0:  # the norms of the sharded gradients are summed over ranks: the global norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if pending:  # the optimizer must not change weights a save is still copying
                pending.wait_staged()
            if snapshots:  # nor those a snapshot is still copying
                snapshot_s += snapshots.wait()
            lr = lr_at(cfg, step)  # a function of the step: a resume, even with a new --lr, needs no saved schedule
            for group in optimizer.param_groups:
                group["lr"] = lr
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
            saving = pending is not None and (pending.done_at or math.inf) > t0  # an async save was in flight
            monitor.step(step, mean_loss, lr, dt, tokens_per_step, state_bytes(model, optimizer),
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
                with guard.patient():
                    if pending:  # one save in flight at a time: the previous one commits first
                        finish_save(run, pending)
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
        if stager:
            stager.close()
        if snapshots:  # the last step is on disk: the memory tier has nothing more to offer
            snapshots.remove()
        # The full, unsharded weights, gathered to rank 0: the digest is comparable with DDP's.
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            if cfg.export:
                atomic_save(full_state, cfg.export)
                print(f"exported the model state dict to {cfg.export}", flush=True)
            summary = training_summary(
                device, step_times, tokens_per_step, flops_per_step, strategy="fsdp", world_size=world, steps=step,
                final_loss=mean_loss if step_times else None, param_digest=param_digest(full_state),
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
