"""A tiny causal transformer with RMSNorm and its synthetic data: the model
of the PyTorch demo (torch_demo.py), of the Python tests and of the
benchmark's overlap timing."""
import math

import torch
import torch.nn.functional as F

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 16, 8


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight.to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // HEADS)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(torch.nn.Module):
    """forward(tokens, targets) returns the mean cross-entropy."""

    def __init__(self, seed=0, d_model=D_MODEL, layers=LAYERS):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, d_model)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(SEQ, d_model))
        self.blocks = torch.nn.ModuleList(Block(d_model) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        self.head = torch.nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos.to(self.embed.weight.dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def is_norm(name):
    return "norm" in name


def param_groups(model, lr=None, norm_lr=None):
    """The usual two groups, named: weight decay for matrices, none for
    norms, biases and positions. lr/norm_lr set a group's own lr."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if is_norm(name) or name.endswith("bias") or name == "pos" else decay).append((name, p))
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if lr is not None:
        groups[0]["lr"] = lr
    if norm_lr is not None:
        groups[1]["lr"] = norm_lr
    return groups


def unnamed(groups):
    """The same groups for torch.optim.AdamW, which takes no names."""
    return [{**g, "params": [p for _, p in g["params"]]} for g in groups]


def batch(step, seed=1, size=BATCH):
    """Fresh random tokens every step (fixed seeds). The target is a fixed
    function of the token and of whether the previous one is larger: the
    first part is learnt within ~100 steps, the second needs attention."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    previous = torch.roll(tokens, 1, dims=1)
    return tokens, (3 * tokens + (previous > tokens).long()) % VOCAB


def norm_gains(model):
    """Every RMSNorm gain, as fp32."""
    return torch.cat([p.detach().float().flatten() for name, p in model.named_parameters() if is_norm(name)])
