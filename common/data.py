"""Step-indexed data and learning rate: the global batch of step s is a pure function of (seed, s), and
its learning rate of s (lr_at). Rank r of W takes rows [r*B/W, (r+1)*B/W) of it, so the data position
is exactly the step: nothing about the data is lost on resume, and every world size sees the same
samples.

Synthetic task (default): arithmetic sequences x[t] = (x0 + k*t) mod vocab with a random start x0 and
stride k per row. Predicting a token needs the two before it, so the loss falls from log(vocab) to
near zero within a few hundred steps of a tiny model. With a `source` (anything with `tokens()`, an
array of token ids, and `format`, its description: a token file, opened by the script when --data
asks for one): windows of seq_len + 1 tokens at random offsets of it, so a step reads only the rows
it draws.
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
        """This rank's rows of `step` split into k (inputs, targets) micro-batches of equal size, for
        gradient accumulation: the step's samples are the same whatever k is."""
        per_rank = self.global_batch // world_size
        rows = self.global_rows(step)[rank * per_rank:(rank + 1) * per_rank]
        return [(r[:, :-1], r[:, 1:]) for r in rows.chunk(k)]

    def held_out(self, n, rank, world_size):
        """n fixed batches that no training step draws (each from a negative step's seed), for evaluation:
        the same at every evaluation and at every world size."""
        return [self.batch(-1 - i, rank, world_size) for i in range(n)]


def eval_batches(cfg, rank, world_size, source=None):
    """--eval-every: the --eval-batches held-out batches of `source` (--val-data, else --data; None: the
    synthetic task) that every evaluation uses, announced by rank 0; [] when evaluation is off."""
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
