"""Reference decoder-only transformer (GPT and LLaMA families) in plain PyTorch.

The model knows nothing of distribution. Two rules keep it friendly to the compiler:
- every layer is ``block(x) -> x`` inside ``self.blocks`` (an ``nn.ModuleList``), so the
  pipeline can cut between blocks and send only the hidden states;
- head counts are derived from weight shapes at run time (``view(B, T, -1, head_dim)``), so a
  tensor-parallel rewrite that shards q/k/v by heads needs no change here.
The forward takes ``input_ids`` and ``labels`` and returns the mean cross-entropy loss
(or the logits when ``labels`` is None).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from .attention import causal_attention
from .initialize import initialize


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and flavour of a decoder-only transformer."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    vocab: int = 50304
    kv_heads: int | None = None  # None: same as heads (multi-head); fewer: grouped-query
    max_seq: int = 2048
    bias: bool = False
    tied_head: bool = False
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    activation: str = "gelu"  # "gelu" (4x MLP) | "swiglu"
    positions: str = "absolute"  # "absolute" (learned) | "rotary"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    family: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        checks = [
            (self.hidden > 0, "hidden must be positive"),
            (self.ffn > 0, "ffn must be positive"),
            (self.layers > 0, "layers must be positive"),
            (self.heads > 0 and self.hidden % self.heads == 0, "hidden must be divisible by heads"),
            (self.num_kv_heads > 0 and self.heads % self.num_kv_heads == 0, "heads must be divisible by kv_heads"),
            (self.vocab > 0, "vocab must be positive"),
            (self.norm in ("layernorm", "rmsnorm"), f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}"),
            (self.activation in ("gelu", "swiglu"), f"activation must be 'gelu' or 'swiglu', got {self.activation!r}"),
            (self.positions in ("absolute", "rotary"), f"positions must be 'absolute' or 'rotary', got {self.positions!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"TransformerConfig: {message}")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TransformerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TransformerConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def make_norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (shardable by heads)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rotary = cfg.positions == "rotary"
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.o.residual_projection = True  # its initial weights are scaled down with depth
        if self.rotary:
            self.rope_theta = cfg.rope_theta
            self.register_buffer("inv_freq", self.rotary_frequencies(), persistent=False)

    def rotary_frequencies(self) -> torch.Tensor:
        return 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def apply_rotary(self, x: torch.Tensor, seq: int) -> torch.Tensor:
        positions = torch.arange(seq, device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [T, head_dim]
        cos = angles.cos().to(x.dtype)[None, None]
        sin = angles.sin().to(x.dtype)[None, None]
        return x * cos + rotate_half(x) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.rotary:
            q = self.apply_rotary(q, seq)
            k = self.apply_rotary(k, seq)
        y = causal_attention(q, k, v)  # flash-attn on a GPU where installed, else SDPA (grouped-query aware)
        y = y.transpose(1, 2).contiguous().view(batch, seq, -1)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
        self.down.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """Embeddings (pre block), ``cfg.layers`` identical blocks, final norm + head + loss (post)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        if cfg.positions == "absolute":
            self.pos_embed = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = make_norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_head:
            self.head.weight = self.embed.weight
        initialize(self)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 style init of one module's own tensors: N(0, 0.02), output projections scaled by
        depth, norms to one (the per-module rule :mod:`.initialize` seeds and applies)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            depth_scale = 1.0 / math.sqrt(2 * self.config.layers)
            std = 0.02 * depth_scale if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Attention) and module.rotary:
            module.inv_freq.copy_(module.rotary_frequencies())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.config.positions == "absolute":
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def parameter_count(cfg: TransformerConfig) -> int:
    """Closed-form parameter count of ``TransformerLM(cfg)`` (the twin of the module's count)."""
    hidden, ffn = cfg.hidden, cfg.ffn
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    norm = hidden * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)
    attention = hidden * hidden * 2 + hidden * kv_dim * 2
    if cfg.bias:
        attention += hidden * 2 + kv_dim * 2
    mlp_mats = 3 if cfg.activation == "swiglu" else 2
    mlp = hidden * ffn * mlp_mats
    if cfg.bias:
        mlp += ffn * (mlp_mats - 1) + hidden
    layer = 2 * norm + attention + mlp
    embeddings = cfg.vocab * hidden + (cfg.max_seq * hidden if cfg.positions == "absolute" else 0)
    head = 0 if cfg.tied_head else cfg.vocab * hidden
    return embeddings + cfg.layers * layer + norm + head
