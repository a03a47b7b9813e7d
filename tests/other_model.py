# A second model, swapped in as docs/model-and-data.md's "Using your own model" says: the test appends this file to a
# copy of common/model.py, so that `Transformer` names it. Unlike the first it has its layers under
# another name (exposed as `blocks` by a property, so they are not registered twice), an embedding tied
# to the head, rotary position embeddings whose table is a non-persistent buffer (not in the state
# dict: FSDP's meta build must fill it), and a persistent buffer (in the state dict, not sharded).
# The imports make the file read on its own; appended, they repeat common/model.py's.
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.model import ModelConfig


class Rotary(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):  # (batch, heads, time, head_dim)
        angles = torch.outer(torch.arange(x.shape[2], device=x.device, dtype=torch.float32), self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        even, odd = x[..., ::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RotaryBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c.heads
        self.norm1, self.norm2 = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.qkv, self.out = nn.Linear(c.dim, 3 * c.dim, bias=False), nn.Linear(c.dim, c.dim, bias=False)
        self.rotary = Rotary(c.dim // c.heads)
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim, bias=False), nn.SiLU(),
                                 nn.Linear(4 * c.dim, c.dim, bias=False), nn.Dropout(c.dropout))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class RotaryLM(nn.Module):
    def __init__(self, c: ModelConfig, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(c.vocab, c.dim)
            self.layers = nn.ModuleList(RotaryBlock(c) for _ in range(c.layers))
            self.norm = nn.RMSNorm(c.dim)
            self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
            self.lm_head.weight = self.embed.weight
            self.register_buffer("logit_scale", torch.full((1,), c.dim ** -0.5 * 4))
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

    @property
    def blocks(self):
        return self.layers

    def forward(self, idx, targets):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x)) * self.logit_scale
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


Transformer = RotaryLM
