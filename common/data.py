"""Step-indexed data: the global batch of step s is a pure function of (seed, s).

Rank r of W takes rows [r*B/W, (r+1)*B/W) of it. The data position is therefore exactly the
step: nothing about the data can be lost on resume, and every world size sees the same
global samples.

Synthetic task (default): arithmetic sequences x[t] = (x0 + k*t) mod vocab with a random start
x0 and stride k per row. Predicting a token needs the two before it, so the loss falls from
log(vocab) to near zero within a few hundred steps of a tiny model.
With `path`: byte windows of a real file (vocab 256) at random offsets.
"""
import torch

MAX_STRIDE = 8


class StepData:
    def __init__(self, seed, global_batch, seq_len, vocab, path=None):
        self.seed, self.global_batch, self.seq_len, self.vocab = seed, global_batch, seq_len, vocab
        self.bytes = None
        if path:
            with open(path, "rb") as f:
                self.bytes = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
            if len(self.bytes) < seq_len + 2:
                raise ValueError(f"{path} has {len(self.bytes)} bytes, fewer than --seq-len + 2")

    def global_rows(self, step):
        """All global_batch rows of `step`, each seq_len + 1 tokens long."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n, t = self.global_batch, self.seq_len + 1
        if self.bytes is not None:
            start = torch.randint(0, len(self.bytes) - t + 1, (n, 1), generator=g)
            return self.bytes[start + torch.arange(t)]
        x0 = torch.randint(0, self.vocab, (n, 1), generator=g)
        k = torch.randint(1, MAX_STRIDE + 1, (n, 1), generator=g)
        return (x0 + k * torch.arange(t)) % self.vocab

    def batch(self, step, rank, world_size):
        """(inputs, targets) for this rank at `step` (step = completed optimizer steps before it)."""
        per_rank = self.global_batch // world_size
        rows = self.global_rows(step)[rank * per_rank:(rank + 1) * per_rank]
        return rows[:, :-1], rows[:, 1:]
