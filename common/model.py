"""A small GPT-style Transformer: token + position embedding, pre-norm blocks, a head. Weights depend only on
the seed; `model.blocks` is the list FSDP shards block by block."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.config import FRACTION, POSITIVE, range_problems


@dataclass
class ModelConfig:
    vocab: int = 64
    seq_len: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.0
    tie_head: bool = False


# Model shapes by name (--preset): the comparison's CPU sizes, then GPT-2-like shapes for a GPU.
# Parameters: 12*dim^2*layers + 13*dim*layers + (2*vocab + seq_len)*dim.
PRESETS = {
    "tiny": dict(vocab=64, seq_len=32, dim=64, layers=2, heads=4),
    "small": dict(vocab=64, seq_len=32, dim=128, layers=3, heads=4),
    "medium": dict(vocab=64, seq_len=32, dim=192, layers=4, heads=6),
    "160m": dict(vocab=50304, seq_len=1024, dim=768, layers=12, heads=12),
    "400m": dict(vocab=50304, seq_len=1024, dim=1024, layers=24, heads=16),
    "1b": dict(vocab=50304, seq_len=2048, dim=2048, layers=18, heads=16),
}

# The fields that fix the shape of the weights: a checkpoint made with other values cannot be loaded.
SHAPE_FIELDS = ("vocab", "seq_len", "dim", "layers", "heads", "tie_head")
# The valid values of the model's flags (each script's RANGES has its training flags').
RANGES = {"vocab": POSITIVE, "seq_len": POSITIVE, "dim": POSITIVE, "layers": POSITIVE, "heads": POSITIVE,
          "dropout": FRACTION}


def model_problems(cfg):
    """Problems with the model's flags in a script's flat config, each one line for the user."""
    problems = range_problems(cfg, RANGES)
    if not problems and cfg.dim % cfg.heads:
        problems.append(f"--heads {cfg.heads} does not divide --dim {cfg.dim}")
    return problems


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.heads, c.dropout
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.dim), Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.GELU(), nn.Linear(4 * c.dim, c.dim), nn.Dropout(c.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the init draws leave the global RNG untouched
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(c.vocab, c.dim)
            self.pos_emb = nn.Embedding(c.seq_len, c.dim)
            self.drop = nn.Dropout(c.dropout)
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
            self.ln_f = nn.LayerNorm(c.dim)
            self.head = nn.Linear(c.dim, c.vocab, bias=False)
            if c.tie_head:
                self.head.weight = self.tok_emb.weight
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def model_config(cfg):
    """The ModelConfig part of a script's flat config."""
    return ModelConfig(vocab=cfg.vocab, seq_len=cfg.seq_len, dim=cfg.dim, layers=cfg.layers,
                       heads=cfg.heads, dropout=cfg.dropout, tie_head=cfg.tie_head)


def num_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def num_params_of(cfg):
    """The parameters of `cfg`'s model, counted on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return num_params(Transformer(model_config(cfg)))
