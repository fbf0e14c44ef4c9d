"""Next-token sampling on the last stage: greedy, or temperature + top-p with a seed.

The random draw for a sequence is seeded by (request seed, position) alone, so the same
request gives the same tokens whatever else shares its micro-batches.
"""
from __future__ import annotations

import zlib

import torch

from pp_runtime.core.batch import Sampling


def _draw(probs: torch.Tensor, seed: int, position: int) -> int:
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}/{position}".encode()))
    return int(torch.multinomial(probs.cpu(), 1, generator=g))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalize.
    probs: [vocab]."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    mass_before = sorted_p.cumsum(0) - sorted_p  # mass of strictly more likely tokens
    sorted_p = torch.where(mass_before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return kept / kept.sum()


def sample(logits: torch.Tensor, samplings: list[Sampling], positions: list[int]) -> list[int]:
    """logits: [N, vocab] float32; one Sampling and the position of the token to be
    generated per row. Returns N token ids."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (s, pos) in enumerate(zip(samplings, positions)):
        if s.temperature == 0.0:
            out.append(greedy[row])
            continue
        probs = torch.softmax(logits[row] / s.temperature, dim=-1)
        out.append(_draw(top_p_filter(probs, s.top_p), s.seed, pos))
    return out
