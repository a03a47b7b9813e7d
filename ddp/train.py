"""DistributedDataParallel training that survives crashes: an atomic rank-0 checkpoint and auto-resume.

    bash run.sh ddp 4                                  # torchrun, 4 ranks, restarts on failure
    FT_FAULTS=crash-at-step=25 bash run.sh ddp 2 --steps 40 --save-every 10   # see a crash recovered
    bash run.sh ddp 2 --steps 40 --save-every 10 --async-save          # saves written while training goes on
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 ddp/train.py       # the variable makes restarts reliable (README)
    python ddp/train.py --export model.pt              # one process, no torchrun; the final weights as one file
    bash run.sh ddp 4 --survivors --spares 1           # a dead rank replaced alone, by a waiting spare

Every rank holds the whole model; gradients are all-reduced. Rank 0 saves one file atomically (ddp/checkpoint.py)
and every rank resumes from the newest that loads. Data and learning rate are functions of the step, so a
restarted job ends with exactly the weights of one that never crashed. A loss that is not finite stops the
job before it saves. The optional tiers (tiers/) plug in where their flags ask, each in one `if` block.
"""
import contextlib
import dataclasses
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
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import atomic_save, atomic_write_json, newest_resume_problem, param_digest
from common.config import (AT_LEAST_ONE, HANG, HOURS, NON_NEGATIVE, POSITIVE, SHARED_RANGES, fail, flag_problems,
                           needs, parse_config)
from common.data import StepData, eval_batches, lr_at
from common.dist import (StepGuard, device_problems, ending_without_finalizing, peer_loss_in_one_line, print0,
                         restarts, setup, teardown)
from common.model import PRESETS, SHAPE_FIELDS, Transformer, model_config, model_problems, num_params, num_params_of
from common.monitor import (Monitor, eval_loss, mfu, peak_flops_problems, peak_since_reset, reset_peak, state_bytes,
                            training_summary)
from common.rundir import hold_run_dir, ownership_problems, run_dir_problems
from ddp.checkpoint import FORMAT, SAMPLE_FIELDS, Checkpointer, read_checkpoint


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
    export: str = ""  # at the end, torch.save the model state dict to this file (for common.model.Transformer)
    allow_changes: bool = False  # resume even if --seed, --batch-size or --data differ from the checkpoint's
    survivors: bool = False  # (run.sh) a dead rank is replaced alone; the others keep running (tiers/survivors.py)
    spares: int = 0  # --survivors: processes that wait warm to take a dead rank's place at once
    archive: str = ""  # s3://bucket/prefix: each committed checkpoint is copied there in the background; a run folder without one resumes from it
    light_every: Optional[int] = None  # every N steps, the model's weights alone in light/step-NNNNNNNN.pt (plain torch.load; never resumed from)
    light_keep: int = 2  # --light-every: the light checkpoints kept


# The valid values of the numeric flags above (common/config.py's rules; the model's are in common/model.py).
RANGES = {**SHARED_RANGES, "mtbf_h": HOURS, "hang_timeout_s": HANG, "grad_accum": AT_LEAST_ONE,
          "eval_every": NON_NEGATIVE, "eval_batches": AT_LEAST_ONE, "snapshot_every": NON_NEGATIVE,
          "spares": NON_NEGATIVE, "light_every": POSITIVE, "light_keep": POSITIVE}


def check(cfg):
    """Every problem with the flags, the environment and the run folder, before training starts."""
    problems = (model_problems(cfg) + flag_problems(cfg, int(os.environ.get("WORLD_SIZE", 1)), RANGES)
                + device_problems(cfg.device) + peak_flops_problems() + run_dir_problems(cfg.run_dir, cfg.export)
                + ownership_problems(cfg.run_dir, ["light"] if cfg.light_every else []))
    if os.environ.get("FT_FAULTS"):  # the tests' faults (tiers/faults.py)
        from tiers.faults import fault_problems
        problems += fault_problems("ddp")
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
    resume = newest_resume_problem(Path(cfg.run_dir) / "ckpt", cfg, lambda p: read_checkpoint(p, mmap=True), FORMAT,
                                   SHAPE_FIELDS, SAMPLE_FIELDS)  # the newest readable checkpoint must fit
    problems += [resume] if resume else []
    if cfg.archive:  # the object store answers; with no checkpoint here, its newest must fit (tiers/archive.py)
        with needs("--archive"):
            from tiers.archive import tier_problems
        problems += tier_problems(cfg, FORMAT, SHAPE_FIELDS, SAMPLE_FIELDS)
    if not problems and cfg.snapshot_every:  # room for the memory tier's slots (tiers/snapshot.py)
        with needs("--snapshot-every", 0):
            from tiers.snapshot import tier_problems
        problems += tier_problems(cfg, num_params_of(cfg), sharded=False)  # one copy per node
    return problems


def forward_backward(ddp_model, micro_batches, device, bf16):
    """Forward and backward over the step's micro-batches; returns their mean loss. Only the last all-reduces."""
    loss = 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                micro = ddp_model(inputs.to(device), targets.to(device))
            micro = micro / len(micro_batches)
            micro.backward()
        loss = loss + micro.detach()
    return loss


def wrap(model, device):
    """The DDP model and its CommTimer. find_unused_parameters keeps the first step's buckets, which DDP would
    regroup, so that a resumed or rebuilt model sums in the same order (without it, 4 ranks' weights differed)."""
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True)
    comm = CommTimer()
    ddp_model.register_comm_hook(None, comm.hook)
    return ddp_model, comm


class CommTimer:
    """A DDP comm hook that all-reduces like the default one and times it; pop() gives the seconds since the last
    call, on gloo only: NCCL's futures complete once it is queued (pytorch PR 48503), so it would time the launch."""

    def __init__(self):
        self.seconds = None

    def hook(self, state, bucket):
        start = time.perf_counter()
        tensor = bucket.buffer().div_(dist.get_world_size())
        future = dist.all_reduce(tensor, async_op=True).get_future()
        if tensor.is_cuda:
            return future.then(lambda fut: fut.value()[0])

        def done(fut):
            self.seconds = (self.seconds or 0.0) + time.perf_counter() - start
            return fut.value()[0]

        return future.then(done)

    def pop(self):
        seconds, self.seconds = self.seconds, None
        return seconds


# ----------------------------------------------------------------------------- tiers
def start(cfg):
    """(team, rank, world size, device): setup()'s, or --survivors' (a spare waits in join() for a rank)."""
    if cfg.survivors:
        from tiers.survivors import join
        return join(cfg)
    return (None, *setup(cfg.device, cfg.timeout_s))


def open_tiers(cfg, rank, world, model, optimizer, monitor):
    """(the tiers the checkpointer calls beside the disk, the tests' faults or None), each if its flag asks."""
    tiers, faults = [], None
    if os.environ.get("FT_FAULTS"):
        from tiers.faults import Faults
        faults = Faults(cfg, rank, world)
    if cfg.snapshot_every:  # the memory tier: each rank's RNG; the state once a node, a part copied by each rank
        from tiers.snapshot import node_ranks, open_tier
        tiers.append(open_tier(cfg, Path(cfg.run_dir) / "ckpt", model, optimizer, node_ranks(), SAMPLE_FIELDS,
                               "records", faults))
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
        print0(f"ddp: world size {world}, device {device}, restart {restarts()}")
        monitor = Monitor(run_dir, rank, device, cfg.log_every)

        # --------------------------------------------------------------------- data
        data, val_batches = load_data(cfg, rank, world)  # --eval-every: the same val_batches every time
        tokens_per_step = cfg.batch_size * cfg.seq_len

        # --------------------------------------------------------------------- model and optimizer
        baseline = reset_peak(device)
        model = Transformer(model_config(cfg), seed=cfg.seed).to(device)
        # Peak memory of construction above what the process held before it: the whole model, on every rank.
        monitor.event("built", baseline_bytes=baseline, peak_bytes=peak_since_reset(device),
                      full_model_bytes=4 * num_params(model))
        # Fused AdamW on the GPU; the CPU keeps the default, whose weights the DDP and FSDP digests are compared on.
        fused = True if device.type == "cuda" else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
        bf16 = cfg.bf16 and device.type == "cuda"
        flops_per_step = 6 * num_params(model) * tokens_per_step / world  # model FLOPs of one rank, for MFU
        print0(f"model: {num_params(model):,} parameters, {'bf16' if bf16 else 'fp32'} compute"
               f"{', fused AdamW' if fused else ''}")

        # --------------------------------------------------------------------- resume
        guard, step_times = StepGuard(device, cfg.timeout_s, cfg.hang_timeout_s), []  # SIGTERM, hangs: common.dist
        tiers, faults = open_tiers(cfg, rank, world, model, optimizer, monitor)  # the memory tier, the archive, ...
        checkpointer = Checkpointer(cfg, rank, world, device, model, optimizer, monitor, guard, step_times, tiers,
                                    faults=faults)
        resumed_from = checkpointer.resume(LAUNCHED_AT)  # from memory, else from disk, else a fresh start
        step = resumed_from or 0
        ddp_model, comm = wrap(model, device)

        # --------------------------------------------------------------------- training loop
        while step < cfg.steps:
            with team or contextlib.nullcontext():  # --survivors: a peer lost in this step ends it here
                t0 = time.perf_counter()
                # ----------------------------------------------------------------- TRAINING SECTION BEGIN
                optimizer.zero_grad(set_to_none=True)
                if faults:  # crash-in-backward: this rank dies in its backward, its peers wait in DDP's reducer
                    faults.in_backward(model, step)
                loss = forward_backward(ddp_model, data.micro_batches(step, rank, world, cfg.grad_accum), device, bf16)
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                lr = lr_at(cfg, step)  # a function of the step: a resume, even with a new --lr, needs no saved schedule
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()  # (the memory tier's hook first waits for its copy of the weights)
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
                monitor.step(step, mean_loss, lr, dt, tokens_per_step, state_bytes(model, optimizer), comm_s=comm.pop(),
                             mfu=mfu(flops_per_step, dt, device), **checkpointer.in_flight(t0))
                guard.shorten_timeout(step_times)
                if faults:  # crash-at-step (tiers/faults.py): this rank dies now, before the step is saved
                    faults.after_step(step)
                if cfg.eval_every and step % cfg.eval_every == 0:  # draws no random number: training goes on as without it
                    monitor.evaluation(step, *eval_loss(model, val_batches, device, bf16))
                checkpointer.save(step, stop=stop)
            if team and team.lost:  # re-formed with the newcomer, from the newest step every rank holds
                step, checkpointer = team.recover(checkpointer, device, step)
                ddp_model, comm = wrap(model, device)  # a reducer of the new group, its buckets as at the start

        # --------------------------------------------------------------------- teardown
        checkpointer.finish(done=True)  # the last save commits; the tiers close (the memory tier's files go)
        if rank == 0 and cfg.export:
            atomic_save(model.state_dict(), cfg.export)
            print(f"exported the model state dict to {cfg.export}", flush=True)
        if rank == 0 and not step_times and (run_dir / "summary.json").exists():  # a finished run launched again
            print0(f"the run was finished at step {step}: nothing to train (a larger --steps trains on), "
                   "its summary.json is kept")
        elif rank == 0:
            summary = training_summary(
                device, step_times, tokens_per_step, flops_per_step, strategy="ddp", world_size=world, steps=step,
                final_loss=mean_loss if step_times else None, param_digest=param_digest(model.state_dict()),
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
