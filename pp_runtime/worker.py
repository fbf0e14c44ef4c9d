"""A stage worker: one pipeline stage (layers [lo, hi)) and its KV cache.

`execute(mb, x)` runs the stage's layers over every token of a micro-batch. Stage 0 takes
the token ids from the plan itself; other stages take the previous stage's hidden states.
The last stage computes logits only for the rows that sample, samples, and returns token
ids. Each call records a `StageTiming`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pp_runtime.batch import MicroBatch, SampledTokens, StageTiming
from pp_runtime.config import Config
from pp_runtime.device import now, torch_dtype
from pp_runtime.model.attention import BatchLayout
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.model.loader import load_stage_weights
from pp_runtime.model.transformer import StageModel, stage_layers
from pp_runtime.sampling import sample


class StageWorker:
    def __init__(self, cfg: Config, stage: int, device: torch.device,
                 checkpoint: str | Path | None = None):
        m = cfg.model
        self.cfg, self.stage, self.device = cfg, stage, device
        self.lo, self.hi = stage_layers(m.num_layers, cfg.parallel.pp, stage)
        dtype = torch_dtype(m.dtype)
        with torch.device(device):
            model = StageModel(m, self.lo, self.hi, cfg.parallel.tp)
        model.to(dtype)
        if checkpoint is None:
            model.init_random(cfg.runtime.seed)
        else:
            load_stage_weights(model, checkpoint)
        self.model = model.eval().requires_grad_(False)
        self.cache = KVCache.for_stage(cfg, self.hi - self.lo, dtype, device)

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def input_ids(self, mb: MicroBatch) -> torch.Tensor:
        ids = [t for s in mb.seqs for t in s.token_ids]
        return torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]

    @torch.inference_mode()
    def forward(self, mb: MicroBatch, x: torch.Tensor | None) -> tuple[torch.Tensor, BatchLayout]:
        """Hidden states [num_tokens, hidden] after this stage's layers."""
        layout = BatchLayout.build(mb, self.device)
        if self.model.is_first:
            x = self.input_ids(mb)
        return self.model(x, self.cache, layout), layout

    @torch.inference_mode()
    def execute(self, mb: MicroBatch, x: torch.Tensor | None = None,
                wait_s: float = 0.0, transfer_s: float = 0.0):
        """Returns (hidden states, timing) on inner stages and (SampledTokens, timing) on
        the last stage."""
        start = now(self.device)
        hidden, layout = self.forward(mb, x)
        out = hidden
        if self.is_last:
            seqs = [s for s in mb.seqs if s.sampling is not None]
            logits = self.model.logits(hidden[layout.sample_rows])  # [num_sampling, vocab]
            ids = sample(logits, [s.sampling for s in seqs], [s.kv_len for s in seqs])
            out = SampledTokens(mb.mb_id, {s.request_id: t for s, t in zip(seqs, ids)})
        timing = StageTiming(mb.mb_id, self.stage, 0, wait_s, transfer_s, start, now(self.device))
        return out, timing
