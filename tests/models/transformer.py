"""A small transformer in PyTorch: embedding 256, 4 heads, MLP 1024, pre-LayerNorm blocks."""

from __future__ import annotations

import torch


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = torch.nn.Linear(dim, dim)
        self.k_proj = torch.nn.Linear(dim, dim)
        self.v_proj = torch.nn.Linear(dim, dim)
        self.out_proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        width = dim // self.heads

        def split(y):
            return y.reshape(batch, seq, self.heads, width).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        weights = torch.softmax(q @ k.transpose(-1, -2) / width ** 0.5, dim=-1)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(batch, seq, dim))


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(256)
        self.attn = Attention()
        self.ln2 = torch.nn.LayerNorm(256)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(torch.nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
