"""Per-rank metrics as JSON lines in <run-dir>/metrics-rank<r>.jsonl: each step's, and events (save, load, eval...)."""
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule



def local_bytes(t):
    """Bytes this rank holds for a tensor: the local shard of a DTensor, else the tensor."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model, optimizer):
    """Exact bytes of model state on this rank: parameters, gradients and optimizer state (local shards only)."""
    params = {id(p): p for p in model.parameters()}.values()
    n = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params)
    for state in optimizer.state.values():
        n += sum(local_bytes(v) for v in state.values() if torch.is_tensor(v))
    return n


def memory(device):
    """Peak memory: the CUDA allocator's peak on GPU; on CPU the process RSS peak."""
    if device.type == "cuda":
        return {"cuda_peak_bytes": torch.cuda.max_memory_allocated(device)}
    return {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def reset_peak(device):
    """Start a peak-memory window; return the bytes in use now. (CPU: writing "5" to clear_refs resets VmHWM.)"""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_bytes("VmRSS")


def peak_since_reset(device):
    """Peak bytes since the last reset_peak: the CUDA allocator's, or the process's RSS on CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _proc_status_bytes("VmHWM")


def _proc_status_bytes(field):
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


# Dense bf16 peak FLOP/s of a GPU (datasheets) by part of its name, first match wins; PEAK_TFLOPS overrides it.
BF16_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def peak_flops(device):
    """The device's dense bf16 peak in FLOP/s, or None where it is not known (the CPU, other GPUs)."""
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    return bf16_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_problems():
    """['PEAK_TFLOPS ... must be a positive number'] if the environment's override is not one, else []."""
    peak = os.environ.get("PEAK_TFLOPS", "")
    try:
        if peak and not (math.isfinite(float(peak)) and float(peak) > 0):
            raise ValueError
    except ValueError:
        return [f"PEAK_TFLOPS (the device's bf16 peak, for MFU) must be a positive number, got {peak!r}"]
    return []


def bf16_peak(gpu_name):
    return next((peak for part, peak in BF16_PEAK_FLOPS if part in gpu_name), None)


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def training_summary(device, step_times, tokens_per_step, flops_per_step, **fields):
    """summary.json of ddp and fsdp: `fields`, the median step time, tokens/s, MFU, device and peak memory."""
    median_s = statistics.median(step_times) if step_times else None
    return {**fields, "median_step_s": median_s,
            "tokens_per_s": tokens_per_step / median_s if step_times else None,
            "mfu": mfu(flops_per_step, median_s, device) if step_times else None,
            "device": device_name(device), **memory(device)}


def mfu(flops, seconds, device):
    """Model FLOPs utilisation: `flops` done in `seconds` on one device, over its bf16 peak (None if unknown)."""
    peak = peak_flops(device)
    return flops / seconds / peak if peak and seconds > 0 else None


def eval_loss(model, batches, device, bf16=False):
    """(the mean loss of `batches` over all ranks, seconds); in eval mode no dropout draws a random number."""
    t0 = time.perf_counter()
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        total = sum(model(x.to(device), y.to(device)).float() for x, y in batches)
    model.train()
    for module in model.modules():  # FSDP2: a no-grad forward leaves the root's gathered weights in place
        if isinstance(module, FSDPModule):
            module.reshard()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size()), time.perf_counter() - t0


class Monitor:
    def __init__(self, run_dir, rank, device, log_every=10):
        self.rank, self.device, self.log_every = rank, device, log_every
        self.file = open(Path(run_dir) / f"metrics-rank{rank}.jsonl", "a")

    def event(self, kind, **fields):
        if self.file is None:
            return
        try:
            self.file.write(json.dumps({"event": kind, "rank": self.rank, "time": time.time(), **fields}) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: training goes on (its next save stops the job, exit 3) without them
            print(f"rank {self.rank}: writing {self.file.name} failed ({e.strerror}): no more metrics from this rank",
                  file=sys.stderr, flush=True)
            self.file = None

    def step(self, step, loss, lr, dt, tokens, model_state_bytes, **extra):
        mem = memory(self.device)
        self.event("step", step=step, loss=loss, lr=lr, step_s=dt, tokens_per_s=tokens / dt,
                   state_bytes=model_state_bytes, **mem, **extra)
        if self.rank == 0 and (step % self.log_every == 0 or step == 1):
            peak = next(iter(mem.values()))
            utilisation = f" | mfu {extra['mfu']:.1%}" if extra.get("mfu") is not None else ""
            print(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | dt {dt * 1000:6.1f} ms"
                  f" | tok/s {tokens / dt:8.0f}{utilisation} | mem {peak / 2**20:.0f} MiB", flush=True)

    def evaluation(self, step, loss, seconds):
        self.event("eval", step=step, loss=loss, eval_s=seconds)
        if self.rank == 0:
            print(f"eval {step:5d} | val loss {loss:.4f} | {seconds * 1000:.0f} ms", flush=True)

    def close(self):
        if self.file is not None:
            self.file.close()
