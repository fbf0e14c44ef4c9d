"""What a profile measures and how hard: the grid of points (`ProfileGrid`, from a config's
sequence length, batch and chunk) and the effort per point (`Effort`: QUICK or FULL).

Plain data, no torch: the profiler (`measure.py`) and its send/recv half (`p2p.py`) both
read it, and neither imports the other for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pp_runtime.config import Config

# grids (full, quick); each is capped by the config's sequence length and batch size
TOKENS = ((1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096),
          (1, 8, 64, 256, 1024, 4096))  # rows of one micro-batch
CHUNKS = ((16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096),
          (32, 128, 512, 2048))  # prefill chunk C
CACHED = ((0, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072),
          (0, 128, 512, 2048))  # K cached before a chunk
DECODE_BATCH = ((1, 2, 4, 8, 16, 32, 64, 128, 256), (1, 4, 16, 64))  # decodes b
DECODE_CACHED = ((32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096),
                 (64, 512, 2048))  # K before a decode; it attends to K + 1 keys


@dataclass(frozen=True)
class Effort:
    """How long to time each point: warm-up calls, then repeats that fit `budget_s`."""

    warmup: int  # untimed calls first (allocator, caches, kernel selection)
    min_repeats: int  # timed calls, at least
    max_repeats: int  # timed calls, at most
    budget_s: float  # seconds of timed calls aimed for per point, within those bounds


QUICK = Effort(warmup=1, min_repeats=3, max_repeats=10, budget_s=0.05)
FULL = Effort(warmup=2, min_repeats=5, max_repeats=30, budget_s=0.3)


@dataclass(frozen=True)
class ProfileGrid:
    """Every point a profile measures: one row of its table each."""

    num_tokens: tuple[int, ...]  # mlp.csv rows
    prefills: tuple[tuple[int, int], ...]  # attention.csv prefill rows: (chunk C, cached K)
    decodes: tuple[tuple[int, int], ...]  # attention.csv decode rows: (batch b, cached K)
    send_tokens: tuple[int, ...]  # send_recv.csv rows

    @property
    def size(self) -> int:
        return len(self.num_tokens) + len(self.prefills) + len(self.decodes) + len(self.send_tokens)


def _upto(grid: tuple[int, ...], cap: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The grid points <= cap, plus cap itself (so nothing needs extrapolating) and extras."""
    return tuple(sorted({n for n in (*grid, *extra) if n <= cap} | {cap}))


def profile_grid(cfg: Config, quick: bool = False) -> ProfileGrid:
    """The points `measure_profile(cfg, quick=quick)` measures."""
    i, L, B = int(quick), cfg.seq_len, cfg.batch_rows
    tokens = _upto(TOKENS[i], L + B)  # the largest micro-batch: a whole prompt + decodes
    # fractions of L keep a short sequence length at several chunks and cache sizes
    chunks = _upto(CHUNKS[i], L, (cfg.chunk_tokens, L // 8, L // 4, L // 2))
    cached = sorted({*CACHED[i], L // 4, L // 2})
    prefills = tuple((c, k) for c in chunks if c >= 1 for k in cached if c + k <= L)
    decode_k = [k for k in _upto(DECODE_CACHED[i], L - 1, (L // 2,)) if k >= 1]
    decodes = tuple((b, k) for b in _upto(DECODE_BATCH[i], B) for k in decode_k)
    return ProfileGrid(tokens, prefills, decodes, tokens)
