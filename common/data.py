"""Step-indexed data: step s's global batch is a function of (seed, s), and rank r of W takes its rows
[r*B/W, (r+1)*B/W), so a resume loses no data position and every world size sees the same samples.

The synthetic task: rows x[t] = (x0 + k*t) mod vocab (random x0, stride k); a token needs the two before it,
and a tiny model learns it in a few hundred steps. A `source` (a token file) gives windows at random offsets.
"""
import math

import numpy as np
import torch

MAX_STRIDE = 8


# --------------------------------------------------------------------------- batches
class StepData:
    def __init__(self, seed, global_batch, seq_len, vocab, source=None):
        self.seed, self.global_batch, self.seq_len, self.vocab = seed, global_batch, seq_len, vocab
        self.tokens, self.format = None, f"synthetic arithmetic sequences (vocab {vocab})"
        if source is not None:  # a token file
            self.tokens, self.format = source.tokens(), source.format

    def global_rows(self, step):
        """All global_batch rows of `step`, each seq_len + 1 tokens long."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n, t = self.global_batch, self.seq_len + 1
        if self.tokens is not None:
            start = torch.randint(0, len(self.tokens) - t + 1, (n, 1), generator=g)
            return torch.from_numpy(np.asarray(self.tokens[(start + torch.arange(t)).numpy()], dtype=np.int64))
        x0 = torch.randint(0, self.vocab, (n, 1), generator=g)
        k = torch.randint(1, MAX_STRIDE + 1, (n, 1), generator=g)
        return (x0 + k * torch.arange(t)) % self.vocab

    def batch(self, step, rank, world_size):
        """(inputs, targets) for this rank at `step` (step = completed optimizer steps before it)."""
        return self.micro_batches(step, rank, world_size, 1)[0]

    def micro_batches(self, step, rank, world_size, k):
        """This rank's rows of `step` as k equal (inputs, targets) micro-batches: the same samples for any k."""
        per_rank = self.global_batch // world_size
        rows = self.global_rows(step)[rank * per_rank:(rank + 1) * per_rank]
        return [(r[:, :-1], r[:, 1:]) for r in rows.chunk(k)]

    def held_out(self, n, rank, world_size):
        """n fixed batches, from negative steps' seeds, that no training step draws: the same at every eval."""
        return [self.batch(-1 - i, rank, world_size) for i in range(n)]


def eval_batches(cfg, rank, world_size, source=None):
    """The --eval-batches held-out batches of `source` (None: the synthetic task) every eval uses; [] if off."""
    if not cfg.eval_every:
        return []
    val = StepData(cfg.seed, cfg.batch_size, cfg.seq_len, cfg.vocab, source)
    if rank == 0:
        print(f"eval: every {cfg.eval_every} steps, {cfg.eval_batches} batches of {val.format}", flush=True)
    return val.held_out(cfg.eval_batches, rank, world_size)


def lr_at(cfg, step):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
