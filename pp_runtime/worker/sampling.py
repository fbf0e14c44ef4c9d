"""Next-token sampling on the last stage: greedy, or temperature + top-p with a seed, every
row of a micro-batch at once on the logits' device.

The random draw for a sequence is one uniform number seeded by (request seed, position)
alone, so the same request gives the same tokens whatever else shares its micro-batches.
The rows that sample are filtered and drawn together: softmax(logits / T), sorted, the
smallest set of most likely tokens whose mass reaches top_p kept, and the token where the
kept mass first passes u times its total (inverse CDF). The ids come back to the host in
one copy for the whole micro-batch (greedy rows included): one sync, not one per row.
"""
from __future__ import annotations

import zlib

import torch

from pp_runtime.core.batch import Sampling


def uniform(seed: int, position: int) -> float:
    """The draw of a request at a position: a number in [0, 1) from (seed, position) alone."""
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}/{position}".encode()))
    return float(torch.rand(1, generator=g, dtype=torch.float64))


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


def _draw_rows(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """logits [H, vocab] of the rows that sample; params [3, H] float64: temperature, top_p,
    the uniform draw. Returns the drawn ids [H] (long, on the logits' device)."""
    temps, tops, u = params.to(logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)  # [H, vocab]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    kept = torch.where(before < tops[:, None], sorted_p, torch.zeros_like(sorted_p))
    cdf = kept.cumsum(-1)  # [H, vocab], flat past the kept tokens
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # first cdf > u * mass
    return order.gather(1, at.clamp_(max=cdf.shape[1] - 1))[:, 0]


def sample(logits: torch.Tensor, samplings: list[Sampling], positions: list[int]) -> list[int]:
    """logits: [N, vocab] float32; one Sampling and the position of the token to be
    generated per row. Returns N token ids."""
    ids = logits.argmax(dim=-1)  # [N]
    hot = [i for i, s in enumerate(samplings) if s.temperature != 0.0]
    if hot:
        host = torch.tensor([[samplings[i].temperature for i in hot],
                             [samplings[i].top_p for i in hot],
                             [uniform(samplings[i].seed, positions[i]) for i in hot]],
                            dtype=torch.float64)
        rows = torch.tensor(hot, dtype=torch.long)
        if logits.is_cuda:  # pinned: the copies do not wait for the GPU's queue
            host, rows = host.pin_memory(), rows.pin_memory()
        rows = rows.to(logits.device, non_blocking=True)
        ids[rows] = _draw_rows(logits[rows], host.to(logits.device, non_blocking=True))
    return ids.tolist()
