"""Models written the way users write them (factories for ``package.module:function`` specs).

``fused_gpt``: a GPT whose layer list is called ``trunk``, whose attention computes q, k, v with
one fused projection and splits them, reshapes with a hard-coded head count
(``view(B, T, self.n_head, -1)``), ties the head to the embedding, and has biases everywhere:
the cases tensor parallelism used to get silently wrong.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, POSITIONS = 96, 32, 4, 3, 32


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q = q.view(batch, seq, self.n_head, -1).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, -1).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, seq, channels))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = FusedAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class FusedGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(POSITIONS, DIM)
        self.trunk = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.trunk:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def fused_gpt() -> nn.Module:
    return FusedGPT()
