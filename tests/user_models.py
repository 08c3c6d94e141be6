"""Models written the way users write them (factories for ``package.module:function`` specs).

``fused_gpt``: a GPT whose layer list is called ``trunk``, whose attention computes q, k, v with
one fused projection and splits them, reshapes with a hard-coded head count
(``view(B, T, self.n_head, -1)``), ties the head to the embedding, and has biases everywhere:
the cases tensor parallelism used to get silently wrong.

``nano_gpt``: Karpathy's nanoGPT layer as written there (``c_attn(x).split(n_embd, dim=2)``,
``C // n_head`` head sizes, dropout on attention and residuals, ``forward(idx, targets)`` renamed
to ``input_ids, labels``); ``nano_gpt(view_qkv=True)`` takes q, k, v from one
``view(B, T, 3, n_head, head_dim)`` of the fused projection instead.
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


class NanoAttention(nn.Module):
    def __init__(self, dropout: float, view_qkv: bool) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.dropout, self.view_qkv = HEADS, DIM, dropout, view_qkv
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        if self.view_qkv:
            qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoBlock(nn.Module):
    def __init__(self, dropout: float, view_qkv: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = NanoAttention(dropout, view_qkv)
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class NanoGPT(nn.Module):
    def __init__(self, dropout: float = 0.1, view_qkv: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(POSITIONS, DIM)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(NanoBlock(dropout, view_qkv) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)


def nano_gpt(dropout: float = 0.1, view_qkv: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT(dropout, view_qkv)


def nano_gpt_view_qkv() -> nn.Module:
    return nano_gpt(view_qkv=True)
