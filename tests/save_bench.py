"""How fast the scripts' checkpoint writes are against the disk, on one device: a preset's model state
(fp32 weights and AdamW's two moments) written the ways ddp/train.py and fsdp/train.py write it.

    python tests/save_bench.py --model 1b --out save_bench.json   # the GPU check runs this (at 1b)
    .venv/bin/python tests/save_bench.py --model 160m --threads 1,2,8         # on a CPU

Each write goes to a fresh folder in a private one made under --dir, is timed until its bytes are fsync'd, and is removed
before the next (the disk must hold one copy of the state, not one per row):
  disk             the same number of bytes in 64 MiB blocks, fsync'd: what the disk gives to one stream
                   (the ratios' reference, as `dd` was in issue 11's table), then split over as many
                   files and threads as DCP's most: what it gives to parallel writers
  torch.save       ddp/train.py's synchronous save: rank 0's atomic_save of the state (GPU -> CPU inside)
  dcp, N threads   fsdp/train.py's synchronous save: dcp.save through fsdp.checkpoint.Writer(thread_count=N)
  dcp async        fsdp/train.py's --async-save (fsdp.checkpoint's staging options: pinned buffers and
                   non-blocking copies on CUDA): what the call blocked, then until staged and committed
Every row is the median of --repeats writes, and its throughput is divided by the disk row's. World
size 1, unsharded tensors: one rank's share of a sharded save at the same bytes. Exit 1 if a write fails.
"""
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` and `fsdp` from anywhere

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tabulate import tabulate
from torch.distributed.checkpoint.staging import DefaultStager

from common.checkpoint import atomic_save, rng_state
from common.config import parse_config
from common.dist import setup, teardown
from common.model import PRESETS, ModelConfig, Transformer
from common.monitor import state_bytes
from fsdp.checkpoint import Writer, staging_options


@dataclass
class Config:
    """Checkpoint write speed of the scripts' saves against a plain fsync'd write of the same bytes."""
    model: str = "medium"  # the model shape: a preset's name (PRESETS in common/model.py)
    device: str = "auto"  # auto (the GPU if there is one), cpu or cuda
    threads: str = "1,8"  # the DCP writer thread counts to time, comma-separated (fsdp/train.py --save-threads)
    repeats: int = 2  # writes of each kind; the median is reported
    dir: str = tempfile.gettempdir()  # on the disk being measured: the writes go to a private folder made there
    out: str = ""  # also write the rows as JSON to this file


def check(cfg):
    problems = [] if cfg.model in PRESETS else [f"--model {cfg.model}: choose from {', '.join(PRESETS)}"]
    if not all(t.strip().isdigit() and int(t) > 0 for t in cfg.threads.split(",")):
        problems.append(f"--threads {cfg.threads}: positive integers, comma-separated")
    problems += [] if os.path.isdir(cfg.dir) else [f"--dir {cfg.dir}: not a folder"]
    return problems + ([] if cfg.repeats > 0 else [f"--repeats must be > 0, got {cfg.repeats}"])


def timed(write, folder):
    """Seconds for `write(folder)` into a fresh folder, which is removed afterwards."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    write(folder)
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder)
    return seconds


def disk_write(nbytes, streams=1):
    """A write of nbytes, split over `streams` files written by as many threads, each fsync'd."""
    block = memoryview(os.urandom(64 << 20))  # not zeros, which a compressing filesystem would not write

    def one(path, n):
        with open(path, "wb", buffering=0) as f:
            for offset in range(0, n, len(block)):
                f.write(block[:n - offset])
            os.fsync(f.fileno())

    def write(folder):
        sizes = [nbytes // streams + (i < nbytes % streams) for i in range(streams)]
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(one, [folder / f"raw-{i}.bin" for i in range(streams)], sizes))
    return write


def main(cfg):
    rank, _, device = setup(cfg.device, timeout_s=1800)
    scratch = None
    try:
        model = Transformer(ModelConfig(**PRESETS[cfg.model]), seed=0).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():  # one step creates AdamW's moments: the state a checkpoint holds
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # a checkpoint holds no gradients
        if device.type == "cuda":  # the async save's copies do not wait for the default stream
            torch.cuda.synchronize()
        nbytes = state_bytes(model, optimizer)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        train = {"step": 1, "config": dataclasses.asdict(cfg)}
        scratch = Path(tempfile.mkdtemp(prefix="save-bench-", dir=cfg.dir))  # removed below, whatever else --dir holds
        folder, rows = scratch / "write", []
        print(f"{cfg.model}: {nbytes / 1e9:.2f} GB of model state on {device}, writes into {scratch}", flush=True)

        def row(name, write, **extra):
            times = [timed(write, folder) for _ in range(cfg.repeats)]
            rows.append({"write": name, "s": statistics.median(times), "times_s": times, **extra})
            print(f"  {name}: {', '.join(f'{t:.2f} s' for t in times)}", flush=True)

        threads = [int(t) for t in cfg.threads.split(",")]
        # The first big write of a process ran up to 5 times slower than the next on this project's shared
        # disks (page cache reclaimed on the way?): one untimed write of up to 2 GB comes first.
        timed(disk_write(min(nbytes, 2 << 30)), folder)
        row("disk (64 MiB blocks, fsync)", disk_write(nbytes))
        row(f"disk, {max(threads)} files in parallel", disk_write(nbytes, max(threads)))
        row("torch.save (ddp/train.py)", lambda f: atomic_save(state, f / "step.pt"))
        for n in threads:
            row(f"dcp, {n} threads (fsdp/train.py)",
                lambda f, n=n: dcp.save(state, storage_writer=Writer(f, train, rng_state(), None, n)))

        cuda = device.type == "cuda"
        save_group = dist.new_group(backend="gloo")  # as fsdp/train.py: an async save needs a CPU backend
        async_times = []

        def async_write(f):
            stager = DefaultStager(staging_options(cuda))
            t0 = time.perf_counter()
            writer = Writer(f, train, rng_state(), save_group, max(threads))
            response = dcp.async_save(state, storage_writer=writer, process_group=save_group, async_stager=stager)
            blocked = time.perf_counter() - t0
            response.staging_completion.result()
            staged = time.perf_counter() - t0
            response.upload_completion.result()
            async_times.append((blocked, staged))
            stager.close()
        row(f"dcp async, {max(threads)} threads (fsdp/train.py --async-save)", async_write)
        rows[-1]["blocked_s"] = statistics.median(b for b, _ in async_times)
        rows[-1]["staged_s"] = statistics.median(s for _, s in async_times)

        disk_s = rows[0]["s"]
        for r in rows:
            r["gb_per_s"], r["of_disk"] = nbytes / r["s"] / 1e9, disk_s / r["s"]
        table = [[r["write"], f"{r['s']:.2f} s", f"{r['gb_per_s']:.2f}", f"{r['of_disk']:.2f}",
                  f"{r['blocked_s'] * 1000:.1f} ms / {r['staged_s']:.2f} s" if "blocked_s" in r else ""]
                 for r in rows]
        print(tabulate(table, headers=["write", "until on disk", "GB/s", "of disk",
                                       "async: loop blocked / staged"]), flush=True)
        if cfg.out:
            Path(cfg.out).write_text(json.dumps({"preset": cfg.model, "device": str(device), "bytes": nbytes,
                                                 "rows": rows}, indent=2) + "\n")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        teardown()


if __name__ == "__main__":
    main(parse_config(Config, check))
