"""FSDP2 training that survives crashes: sharded weights, a distributed checkpoint (DCP) written by
every rank, auto-resume at the same or another world size, and optional async save.

    bash run.sh fsdp 4                                 # torchrun, 4 ranks, restarts on failure
    FT_FAULTS=crash-at-step=25 bash run.sh fsdp 4 --steps 40 --save-every 10   # see a crash recovered
    bash run.sh fsdp 2 --steps 40 --save-every 10 --async-save         # saves overlap training
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 fsdp/train.py      # the variable makes restarts reliable (README)
    python fsdp/train.py --export model.pt             # one process; write the final weights as one file

Each rank holds 1/world of the parameters, gradients and optimizer state (fully_shard per block,
then the root). A checkpoint is a folder ckpt/step-NNNNNNNN/: every rank writes its own shards, then
rank 0 adds train.pt (step, config, every rank's RNG) and DCP's `.metadata` last, which commits it
(fsdp/checkpoint.py builds and reads it). Resume takes the newest committed folder that loads on every
rank (each is tried twice), resharded to the current world size, with the same global batch. Newer
folders that did not load are moved aside, never deleted. A loss that is not finite stops the job
unsaved. The optional tiers (tiers/) plug in where their flags ask for them, each in one `if` block (README).
"""
import contextlib
import dataclasses
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
from common.stop import end_if_stopped  # noqa: E402  (common.stop imports no torch)
end_if_stopped()  # a torchrun restart after a stop of this launch ends here, before importing torch

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.checkpoint import atomic_save, atomic_write_json, newest_resume_problem, param_digest
from common.config import (AT_LEAST_ONE, HANG, HOURS, NON_NEGATIVE, POSITIVE, SHARED_RANGES, fail, flag_problems,
                           needs, parse_config)
from common.data import StepData, eval_batches, lr_at
from common.dist import (StepGuard, device_problems, ending_without_finalizing, peer_loss_in_one_line, print0, restarts,
                         setup, teardown)
from common.model import (PRESETS, SHAPE_FIELDS, Transformer, model_config, model_problems, num_params,
                          num_params_of)
from common.monitor import (Monitor, eval_loss, mfu, peak_flops_problems, peak_since_reset, reset_peak, state_bytes,
                            training_summary)
from common.rundir import hold_run_dir, ownership_problems, run_dir_problems
from fsdp.checkpoint import FORMAT, SAMPLE_FIELDS, Checkpointer


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
    allow_changes: bool = False  # resume even if --seed, --batch-size or --data differ from the checkpoint's
    survivors: bool = False  # (run.sh) a dead rank is replaced alone; the others keep running (tiers/survivors.py)
    spares: int = 0  # --survivors: processes that wait warm to take a dead rank's place at once
    archive: str = ""  # s3://bucket/prefix: each committed checkpoint is copied there in the background; a run folder without one resumes from it
    light_every: Optional[int] = None  # every N steps, the model's weights alone in light/step-NNNNNNNN.pt (plain torch.load; never resumed from)
    light_keep: int = 2  # --light-every: the light checkpoints kept


# The valid values of the numeric flags above (common/config.py's rules; the model's are in common/model.py).
RANGES = {**SHARED_RANGES, "mtbf_h": HOURS, "hang_timeout_s": HANG, "grad_accum": AT_LEAST_ONE,
          "eval_every": NON_NEGATIVE, "eval_batches": AT_LEAST_ONE, "snapshot_every": NON_NEGATIVE,
          "save_threads": POSITIVE, "spares": NON_NEGATIVE, "light_every": POSITIVE, "light_keep": POSITIVE}

def check(cfg):
    """Every problem with the flags, the environment and the run folder, before training starts."""
    problems = (model_problems(cfg) + flag_problems(cfg, int(os.environ.get("WORLD_SIZE", 1)), RANGES)
                + device_problems(cfg.device) + peak_flops_problems() + run_dir_problems(cfg.run_dir, cfg.export)
                + ownership_problems(cfg.run_dir, ["light"] if cfg.light_every else []))
    if os.environ.get("FT_FAULTS"):  # the tests' faults (tiers/faults.py)
        from tiers.faults import fault_problems
        problems += fault_problems("fsdp")
    if cfg.light_every:  # the weights alone (tiers/light.py, opened in main()): a copy without it gets one line
        with needs("--light-every"):
            import tiers.light  # noqa: F401
    if cfg.data or cfg.val_data:  # token files (tiers/tokens.py)
        with needs("--data"):
            from tiers.tokens import data_problems
        problems += data_problems(cfg)
    if cfg.survivors or cfg.spares:  # the processes of this layout must fit the node
        with needs("--survivors"):
            from tiers.survivors import layout_problems
        problems += layout_problems(cfg, num_params_of(cfg))
    resume = newest_resume_problem(Path(cfg.run_dir) / "ckpt", cfg,  # the newest readable checkpoint must fit
                                   lambda p: torch.load(p / "train.pt", map_location="cpu", weights_only=True),
                                   FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
    problems += [resume] if resume else []
    if cfg.archive:  # the object store answers; with no checkpoint here, its newest must fit (tiers/archive.py)
        with needs("--archive"):
            from tiers.archive import tier_problems
        problems += tier_problems(cfg, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
    if not problems and cfg.snapshot_every:  # room for the memory tier's slots (tiers/snapshot.py)
        with needs("--snapshot-every", 0):
            from tiers.snapshot import tier_problems
        problems += tier_problems(cfg, num_params_of(cfg), sharded=True)  # each rank's shards
    return problems


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


def forward_backward(model, micro_batches, device):
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
        micro = model(inputs.to(device), targets.to(device)) / k
        micro.backward()
        loss = loss + micro.detach()
    return loss


def clip_grad_norm(model, max_norm, device):
    """Scales the gradients so that their global L2 norm is at most `max_norm`, bit for bit as
    torch.nn.utils.clip_grad_norm_ does on FSDP2's DTensor gradients, but with the script's own all-reduce
    of the world group in place of DTensor's: a plain collective like guard.agree's, under the step's
    timeout, ended with every other wait by --survivors' watcher. Every gradient is a Shard(0) of the
    world mesh, so each rank's shard counts once. In DTensor's order (its _NormPartial), which the bits
    depend on: each gradient's norm of its local shard, squared, all-reduced as one vector and
    square-rooted, then the norm of those norms; the coefficient max_norm / (norm + 1e-6), at most 1."""
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    squares = (torch.stack(torch._foreach_norm(grads)) ** 2.0).to(device)  # --cpu-offload: NCCL's device
    dist.all_reduce(squares)
    total = torch.linalg.vector_norm(squares ** 0.5, 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))


# ----------------------------------------------------------------------------- checkpoint
# fsdp/checkpoint.py's Checkpointer: a folder ckpt/step-NNNNNNNN/ of every rank's shards of "model" and
# "optimizer" (DCP, by name, as get_state_dict gives them) and train.pt (format, step, world_size,
# config, every rank's RNG), committed by DCP's `.metadata`; resumed at this or another world size.
def build(cfg, rank, world, device, bf16, fused, monitor, guard, step_times):
    """The sharded model, its optimizer, the tiers and the checkpointer over the current process group:
    at the start, and again over a re-formed group (--survivors: shards belong to their group)."""
    # The mesh over the world group, for its timeout (init_device_mesh's group has gloo's 30 minutes).
    model = build_model(cfg, DeviceMesh.from_group(dist.group.WORLD, device.type), device, bf16, monitor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    tiers, faults = open_tiers(cfg, rank, world, model, optimizer, monitor)
    return Checkpointer(cfg, rank, world, device, model, optimizer, monitor, guard, step_times, tiers, faults=faults)


# ----------------------------------------------------------------------------- tiers
def start(cfg):
    """(team, rank, world size, device): setup()'s, or --survivors' (a spare waits in join() for a rank)."""
    if cfg.survivors:
        from tiers.survivors import join
        return join(cfg)
    return (None, *setup(cfg.device, cfg.timeout_s))


def open_tiers(cfg, rank, world, model, optimizer, monitor):
    """(the tiers the checkpointer calls beside the disk, common/checkpointer.py; the tests' faults or None),
    each opened only if its flag asks. (The token files plug in at main's data section.)"""
    tiers, faults = [], None
    if os.environ.get("FT_FAULTS"):
        from tiers.faults import Faults
        faults = Faults(cfg, rank, world)
    if cfg.snapshot_every:  # the memory tier: a rank's shards and RNG, also kept on the next node
        from tiers.snapshot import open_tier
        tiers.append(open_tier(cfg, Path(cfg.run_dir) / "ckpt", model, optimizer, range(rank, rank + 1),
                               SAMPLE_FIELDS, "shards", faults))
    if cfg.light_every:  # the model's weights alone, for a plain torch.load
        from tiers.light import LightCheckpoints
        tiers.append(LightCheckpoints(cfg))
    if cfg.archive:  # each commit copied to S3; a run folder without one resumes from the archive's newest
        from tiers.archive import ArchiveTier
        tiers.append(ArchiveTier(cfg, rank, monitor))
    return tiers, faults


def load_data(cfg, rank, world):
    """(the steps' data, the evaluation's batches): the synthetic task, or --data's token files (tiers/tokens.py)."""
    source = val_source = None  # the synthetic task
    if cfg.data or cfg.val_data:
        from tiers.tokens import sources
        source, val_source = sources(cfg)
    data = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, source)
    print0(f"data: {data.format}" + (f", {cfg.grad_accum} micro-batches a step" if cfg.grad_accum > 1 else ""))
    return data, eval_batches(cfg, rank, world, val_source)


def main(cfg):
    # ------------------------------------------------------------------------- setup
    team, rank, world, device = start(cfg)  # --survivors: the survivors tier's team, else None
    try:
        run_dir = Path(cfg.run_dir)
        hold_run_dir(run_dir, rank)  # rank 0 holds its lock until the process exits
        print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
        print0(f"fsdp: world size {world}, device {device}, restart {restarts()}")
        monitor = Monitor(run_dir, rank, device, cfg.log_every)

        # --------------------------------------------------------------------- data
        data, val_batches = load_data(cfg, rank, world)  # --eval-every: the same val_batches every time
        tokens_per_step = cfg.batch_size * cfg.seq_len

        # --------------------------------------------------------------------- model and optimizer
        bf16 = cfg.bf16 and device.type == "cuda"
        guard = StepGuard(device, cfg.timeout_s, cfg.hang_timeout_s)  # SIGTERM and hangs: see common.dist
        step_times = []

        # Fused AdamW (one kernel for all parameters) where they live on the GPU; the CPU keeps the default,
        # whose weights the DDP and FSDP digests are compared on.
        fused = True if device.type == "cuda" and not cfg.cpu_offload else None

        rebuild = functools.partial(build, cfg, rank, world, device, bf16, fused, monitor, guard, step_times)
        checkpointer = rebuild()  # (--survivors: again over each re-formed group)
        model, optimizer, faults = checkpointer.model, checkpointer.optimizer, checkpointer.faults
        flops_per_step = 6 * num_params(model) * tokens_per_step / world  # model FLOPs of one rank, for MFU
        print0(f"model: {num_params(model):,} parameters, {'bf16' if bf16 else 'fp32'} compute, sharded over {world}"
               f" ranks{', blocks compiled' if cfg.compile else ''}{', fused AdamW' if fused else ''}")

        # --------------------------------------------------------------------- resume
        resumed_from = checkpointer.resume(LAUNCHED_AT)  # from memory, else from disk, else a fresh start
        step = resumed_from or 0

        # --------------------------------------------------------------------- training loop
        while step < cfg.steps:
            with team or contextlib.nullcontext():  # --survivors: a peer lost in this step ends it here
                t0 = time.perf_counter()
                # ----------------------------------------------------------------- TRAINING SECTION BEGIN
                optimizer.zero_grad(set_to_none=True)
                loss = forward_backward(model, data.micro_batches(step, rank, world, cfg.grad_accum), device)
                if cfg.grad_clip > 0:  # the norms of the sharded gradients are summed over ranks: the global norm
                    if faults:  # crash-in-clip: this rank dies as its peers all-reduce the norm
                        faults.before_clip(step)
                    clip_grad_norm(model, cfg.grad_clip, device)
                lr = lr_at(cfg, step)  # a function of the step: a resume, even with a new --lr, needs no saved schedule
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()  # (hooks first wait for the weights a snapshot or an async save is still copying)
                # ----------------------------------------------------------------- TRAINING SECTION END
                # Everything that follows watches the step, and saves it.
                if faults:  # nan-at-step: a diverged loss
                    loss = faults.poison_loss(loss, step)
                step += 1
                mean_loss, stop = guard.agree(loss)  # the loss over all ranks, and whether any rank was signalled
                if not math.isfinite(mean_loss):  # diverged: every rank stops here, before anything is saved
                    checkpointer.finish()  # an earlier step's save in flight, of finite weights: let it commit
                    fail(f"loss is {mean_loss} at step {step}: stopping without saving, the checkpoints of earlier "
                         "steps are kept", code=3)
                dt = time.perf_counter() - t0
                step_times.append(dt)
                monitor.step(step, mean_loss, lr, dt, tokens_per_step, state_bytes(model, optimizer),
                             mfu=mfu(flops_per_step, dt, device), **checkpointer.in_flight(t0))
                guard.shorten_timeout(step_times)
                if faults:  # crash-at-step (tiers/faults.py): this rank dies now, before the step is saved
                    faults.after_step(step)
                if cfg.eval_every and step % cfg.eval_every == 0:  # draws no random number: training goes on as without it
                    monitor.evaluation(step, *eval_loss(model, val_batches, device, bf16))
                checkpointer.save(step, stop=stop)
            if team and team.lost:  # re-formed with the newcomer, from the newest step every rank holds
                step, checkpointer = team.recover(checkpointer, device, step, rebuild=rebuild)
                model, optimizer = checkpointer.model, checkpointer.optimizer

        # --------------------------------------------------------------------- teardown
        checkpointer.finish(done=True)  # the last save commits; the tiers close (the memory tier's files go)
        # The full, unsharded weights, gathered to rank 0: the digest is comparable with DDP's.
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0 and cfg.export:
            atomic_save(full_state, cfg.export)
            print(f"exported the model state dict to {cfg.export}", flush=True)
        if rank == 0 and not step_times and (run_dir / "summary.json").exists():  # a finished run launched again
            print0(f"the run was finished at step {step}: nothing to train (a larger --steps trains on), "
                   "its summary.json is kept")
        elif rank == 0:
            summary = training_summary(
                device, step_times, tokens_per_step, flops_per_step, strategy="fsdp", world_size=world, steps=step,
                final_loss=mean_loss if step_times else None, param_digest=param_digest(full_state),
                resumed_from_step=resumed_from, restarts=restarts(), params=num_params(model), async_save=cfg.async_save,
                state_bytes_per_rank=state_bytes(model, optimizer), generation=team.gen if team else None,
                **checkpointer.summary())
            atomic_write_json(summary, run_dir / "summary.json")
            print0(f"done: step {step}, final loss {summary['final_loss']}, param_digest {summary['param_digest']}")
        monitor.close()
    finally:
        teardown()


if __name__ == "__main__":
    cfg = parse_config(Config, check, presets=PRESETS)
    with ending_without_finalizing(), peer_loss_in_one_line(cfg.run_dir):  # one line here, the traceback in a file
        main(cfg)  # and no finalization after, where gloo may abort the process: see common.dist
