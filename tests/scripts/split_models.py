"""Models the staged-pipeline tests split as they are: a residual CNN with BatchNorm and in-place ReLU,
and Hugging Face's GPT-2 built from a tiny config (tied embeddings; ``transformers`` is a test extra)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ResidualCNN", "tiny_gpt2"]


class _Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU(in place)-conv-BN, plus the input, ReLU in place."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResidualCNN(nn.Module):
    """stem -> 4 residual blocks (an ``nn.Sequential``: the repeated blocks) -> pooled linear head."""

    def __init__(self, channels: int = 8, classes: int = 5, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(*(_Block(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))


def tiny_gpt2(*, layers: int = 4, width: int = 32, vocab: int = 64, positions: int = 16, tied: bool = True) -> Any:
    """``transformers.GPT2LMHeadModel`` from a tiny config, random weights, no download; dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)
