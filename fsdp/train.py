"""FSDP2 training that survives crashes: sharded weights, a distributed checkpoint (DCP) written by
every rank, auto-resume at the same or another world size, and optional async save.

    bash run.sh fsdp 4                                 # torchrun, 4 ranks, restarts on failure
    bash run.sh fsdp 4 --steps 40 --save-every 10 --crash-at-step 25   # see a crash recovered
    bash run.sh fsdp 2 --steps 40 --save-every 10 --async-save         # saves overlap training
    torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint localhost:0 fsdp/train.py
    python fsdp/train.py --export model.pt             # one process; write the final weights as one file

Each rank holds 1/world of the parameters, gradients and optimizer state (fully_shard per block,
then the root). A checkpoint is a folder ckpt/step-NNNNNNNN/: every rank writes its own shards,
rank 0 adds train.pt (step, schedule, config, every rank's RNG) first and DCP's `.metadata` last,
which commits it. Resume takes the newest committed folder that loads on every rank, reshards it
to the current world size, and continues with the same global batch.
"""
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` from anywhere in the repo

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.checkpoint import (atomic_save, atomic_write_json, checkpoints, newest_shape_problem, param_digest, prune,
                               remove, rng_state, seed_rng, set_rng_state, shape_mismatch, step_name)
from common.config import common_problems, fail, parse_config
from common.data import StepData
from common.dist import crash, first_attempt, print0, restarts, setup, teardown
from common.model import Transformer, model_config, num_params
from common.monitor import Monitor, device_name, memory, mfu, state_bytes


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """FSDP2 training with a sharded distributed checkpoint, auto-resume and resharding."""
    steps: int = 200  # total optimizer steps of the job (a resumed job runs up to this)
    run_dir: str = "runs/fsdp"  # holds ckpt/, metrics-rank<r>.jsonl and summary.json
    save_every: int = 50  # save a checkpoint every N steps, and at the last step
    keep: int = 3  # committed checkpoints kept; older ones are deleted after each save
    seed: int = 0  # seeds the weights, the data and each rank's RNG
    device: str = "auto"  # auto (a GPU per local rank if there are enough, else CPU), cpu or cuda
    preset: str = ""  # a named model shape (common.model.PRESETS: tiny ... 1b); replaces vocab, seq_len, dim, layers, heads
    vocab: int = 64  # vocabulary size (256 with --data)
    seq_len: int = 32  # tokens per sequence
    dim: int = 64  # model width
    layers: int = 2  # Transformer blocks
    heads: int = 4  # attention heads; must divide dim
    dropout: float = 0.0  # dropout; its randomness is in the saved RNG state, so resume stays exact
    tie_head: bool = False  # share the output head with the token embedding
    batch_size: int = 24  # global batch: sequences per optimizer step, split evenly across ranks
    data: str = ""  # a text file to train on as bytes (vocab 256) instead of the synthetic task
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup: int = 20  # steps of linear warmup
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    log_every: int = 10  # print a log line every N steps
    timeout_s: int = 300  # collective timeout: a hung peer fails the job instead of stalling it
    bf16: bool = True  # on CUDA: bf16 compute weights, fp32 gradient reduction and fp32 master weights (CPU: fp32)
    reshard_after_forward: bool = True  # free each block's gathered weights after forward; gather again for backward
    async_save: bool = False  # write checkpoints in a background thread while the next steps train
    export: str = ""  # at the end, torch.save the full model state dict to this file (for common.model.Transformer)
    crash_at_step: Optional[int] = None  # fault injection: --crash-rank dies right after step N, before saving
    crash_rank: int = -1  # the rank that --crash-at-step kills (-1: the last rank)
    crash_in_save: Optional[int] = None  # fault injection: rank 0 dies saving step N, shards written, before the commit


def check(cfg):
    problems = common_problems(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    shape = newest_shape_problem(Path(cfg.run_dir) / "ckpt", cfg,  # the newest readable checkpoint must fit
                                 lambda p: torch.load(p / "train.pt", map_location="cpu", weights_only=True)["config"])
    return problems + [shape] if shape else problems


def lr_at(cfg, step):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def agree(ok, device):
    """True only if `ok` holds on every rank, so that all ranks take the same branch after a local failure."""
    flag = torch.tensor(int(ok), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class TornWriter(dcp.FileSystemWriter):
    """--crash-in-save: DCP calls finish() on rank 0 once every rank's shards are on disk, to write
    `.metadata` (the commit). This one dies there instead, leaving a torn, uncommitted folder."""

    def finish(self, metadata, results):
        crash(f"rank 0 while saving {self.path}: shards written, not committed")


def main(cfg):
    # ------------------------------------------------------------------------- setup
    rank, local_rank, world, device = setup(cfg.device, cfg.timeout_s)
    try:
        run_dir, ckpt_dir = Path(cfg.run_dir), Path(cfg.run_dir) / "ckpt"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
        print0(f"fsdp: world size {world}, device {device}, restart {restarts()}")
        monitor = Monitor(run_dir, rank, device, cfg.log_every)
        crash_rank = cfg.crash_rank % world
        mesh = init_device_mesh(device.type, (world,))
        # Async saves run their collectives in a background thread: a group of their own (gloo, as
        # DCP needs a CPU backend for it) keeps them from interleaving with the training collectives.
        save_group = dist.new_group(backend="gloo") if cfg.async_save else None

        # --------------------------------------------------------------------- data
        data = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, cfg.data or None)
        tokens_per_step = cfg.batch_size * cfg.seq_len

        # --------------------------------------------------------------------- model and optimizer
        # Every rank builds the full model from the seed, then keeps only its shard of each tensor.
        model = Transformer(model_config(cfg), seed=cfg.seed).to(device)
        bf16 = cfg.bf16 and device.type == "cuda"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings, final norm, head
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(cfg, s) / cfg.lr)
        flops_per_step = 6 * num_params(model) * tokens_per_step / world  # model FLOPs of one rank, for MFU
        print0(f"model: {num_params(model):,} parameters, {'bf16' if bf16 else 'fp32'} compute,"
               f" sharded over {world} ranks")

        # --------------------------------------------------------------------- resume
        # Rank 0 lists the committed checkpoints, newest first, for everyone. All ranks try each in
        # turn and move on together when any rank fails, so they never load different steps. A failed
        # DCP load may have written part of the live tensors; the load that succeeds overwrites them all.
        candidates = [[path for _, path in checkpoints(ckpt_dir)] if rank == 0 else None]
        dist.broadcast_object_list(candidates, src=0)
        step, resumed_from, train = 0, None, None
        for path in candidates[0]:
            t0, error = time.perf_counter(), None
            try:
                train = torch.load(path / "train.pt", map_location="cpu", weights_only=True)
            except Exception as e:
                error = e
            if agree(error is None, device):
                if shape_mismatch(train["config"], cfg):
                    fail(f"{path}: {shape_mismatch(train['config'], cfg)}; use another --run-dir")
                try:
                    model_state, optim_state = get_state_dict(model, optimizer)
                    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
                    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
                except (Exception, CheckpointException) as e:  # DCP's own error is not an Exception
                    error = e
                if agree(error is None, device):
                    break
            if error is not None:
                reason = str(error).strip().splitlines()[-1][:160]  # DCP's message ends with the root cause
                print(f"rank {rank}: checkpoint {path} unreadable ({type(error).__name__}: {reason})", flush=True)
            print0(f"checkpoint {path.name} did not load on every rank: falling back to the previous one")
            monitor.event("fallback", path=str(path), error=repr(error)[:300] if error else None)
            train = None
        if candidates[0] and train is None:
            fail(f"no checkpoint in {ckpt_dir} loads (see above); remove the damaged ones or use another --run-dir")
        if train is not None:
            scheduler.load_state_dict(train["scheduler"])
            step = resumed_from = train["step"]
            if train["world_size"] == world:
                set_rng_state(train["rng"][rank])
            else:  # each rank's RNG stream cannot carry over to another world size: derive new ones
                seed_rng(cfg.seed + step, rank)
                print0(f"resharded from {train['world_size']} to {world} ranks")
                monitor.event("reshard", step=step, from_world_size=train["world_size"], world_size=world)
            monitor.event("load", step=step, load_s=time.perf_counter() - t0, path=str(path))
            print0(f"resuming from step {step}")
        else:
            seed_rng(cfg.seed, rank)
            print0("no checkpoint, starting fresh")
        # Folders newer than the loaded step are torn saves or unreadable ones: the steps they hold will
        # be trained and saved again, into fresh folders (a committed one is never overwritten in place).
        if rank == 0:
            stale = [(p, "unreadable") for s, p in checkpoints(ckpt_dir) if s > step]
            stale += [(p, "never committed") for _, p in checkpoints(ckpt_dir, committed=False)]
            for p, why in stale:
                remove(p)
                print(f"removed {p.name} ({why})", flush=True)
        monitor.event("start", resumed_from_step=resumed_from, restarts=restarts(), world_size=world)

        def finish_save(save):
            """Wait for a save to commit, then prune and report it (rank 0 counts the bytes on disk)."""
            if save["future"] is not None:
                save["future"].result()
            nbytes = 0
            if rank == 0:
                nbytes = sum(f.stat().st_size for f in save["path"].iterdir())
                prune(ckpt_dir, cfg.keep)
            total_s = save.get("done_at", time.perf_counter()) - save["t0"]  # its callback may run after result()
            monitor.event("save", step=save["step"], blocking_s=save["blocking_s"], total_s=total_s, bytes=nbytes)
            print0(f"saved step {save['step']} ({nbytes / 2**20:.1f} MiB, blocking {save['blocking_s'] * 1000:.0f} ms,"
                   f" total {total_s * 1000:.0f} ms)")

        # An async save first copies the shards into CPU buffers (staging), then writes those in a
        # thread. One stager for the whole run keeps its buffers, a CPU copy of this rank's state, and
        # copies into them again at each save (the previous save has committed by then). Pinned
        # buffers (use_pinned_memory) should copy from a GPU faster; not yet tried on one here.
        stager = None
        if cfg.async_save:
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))

        # --------------------------------------------------------------------- training loop
        loss_sum, step_times, pending = torch.zeros((), device=device), [], None
        while step < cfg.steps:
            t0 = time.perf_counter()
            inputs, targets = (t.to(device) for t in data.batch(step, rank, world))
            loss = model(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # reduce-scatter: each rank ends with the mean gradient of its shard
            if cfg.grad_clip > 0:  # the norms of the sharded gradients are summed over ranks: the global norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum.copy_(loss.detach())
            dist.all_reduce(loss_sum)  # the logged loss is the mean over all ranks
            mean_loss = loss_sum.item() / world
            dt = time.perf_counter() - t0
            step_times.append(dt)
            monitor.step(step, mean_loss, lr, dt, tokens_per_step, state_bytes(model, optimizer),
                         mfu=mfu(flops_per_step, dt, device))

            if cfg.crash_at_step == step and rank == crash_rank and first_attempt():
                crash(f"rank {rank} after step {step}")

            # ----------------------------------------------------------------- checkpoint
            if step % cfg.save_every == 0 or step == cfg.steps:
                t0 = time.perf_counter()
                if pending:  # one save in flight at a time: the previous one commits first
                    finish_save(pending)
                    pending = None
                rngs = [None] * world
                dist.all_gather_object(rngs, rng_state())  # every rank's RNG, saved by rank 0
                path = ckpt_dir / step_name(step)
                if rank == 0:  # written before any shard, so a committed folder always has it
                    path.mkdir(exist_ok=True)
                    atomic_save({"step": step, "world_size": world, "config": dataclasses.asdict(cfg),
                                 "scheduler": scheduler.state_dict(), "rng": rngs}, path / "train.pt")
                model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards, by name
                torn = cfg.crash_in_save == step and first_attempt()
                writer = (TornWriter if torn else dcp.FileSystemWriter)(path)
                save = {"step": step, "path": path, "t0": t0, "future": None}
                if cfg.async_save:  # returns once the shards are copied; the write goes on in a thread
                    save["future"] = dcp.async_save({"model": model_state, "optimizer": optim_state},
                                                    storage_writer=writer, process_group=save_group,
                                                    async_stager=stager)
                    save["future"].add_done_callback(lambda _, save=save: save.update(done_at=time.perf_counter()))
                    save["blocking_s"] = time.perf_counter() - t0
                    pending = save
                else:  # returns once every rank's shards and the commit are on disk
                    dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=writer)
                    save["done_at"] = time.perf_counter()
                    save["blocking_s"] = save["done_at"] - t0
                    finish_save(save)

        # --------------------------------------------------------------------- teardown
        if pending:
            finish_save(pending)
        if stager:
            stager.close()
        # The full, unsharded weights, gathered to rank 0: the digest is comparable with DDP's.
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            if cfg.export:
                atomic_save(full_state, cfg.export)
                print(f"exported the model state dict to {cfg.export}", flush=True)
            summary = {
                "strategy": "fsdp", "world_size": world, "steps": step, "final_loss": mean_loss if step_times else None,
                "param_digest": param_digest(full_state), "resumed_from_step": resumed_from, "restarts": restarts(),
                "params": num_params(model), "state_bytes_per_rank": state_bytes(model, optimizer),
                "median_step_s": statistics.median(step_times) if step_times else None,
                "tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
                "mfu": mfu(flops_per_step, statistics.median(step_times), device) if step_times else None,
                "device": device_name(device), **memory(device),
                "async_save": cfg.async_save,
            }
            atomic_write_json(summary, run_dir / "summary.json")
            print0(f"done: step {step}, final loss {summary['final_loss']}, param_digest {summary['param_digest']}")
        monitor.close()
    finally:
        teardown()


if __name__ == "__main__":
    main(parse_config(Config, check))
    gc.freeze()  # exiting: spare Python's final collection over torch's objects (1.2 s of CPU a process here)
