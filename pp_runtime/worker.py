"""A stage worker: one (pipeline stage, TP rank) shard of the model and its KV cache.

`execute(mb, x)` runs the stage's layers over every token of a micro-batch. Stage 0 takes
the token ids from the plan itself; other stages take the previous stage's hidden states:
in memory from the in-process executor (`x`), or over torch.distributed when the worker
has process groups (each TP rank receives its 1/tp slice from the same TP rank of the
previous stage and all-gathers it, `parallel/p2p.py`). The last stage computes logits only
for the rows that sample, gathers them over the vocabulary and samples (TP rank 0 returns
the token ids). Each call records a `StageTiming`: wait, transfer, compute, and the
time blocked before its send (the next stage had not taken the previous one).
"""
from __future__ import annotations

from pathlib import Path

import torch

from pp_runtime.batch import MicroBatch, SampledTokens, StageTiming
from pp_runtime.config import Config, stage_layers
from pp_runtime.device import now, torch_dtype
from pp_runtime.model.attention import BatchLayout
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.model.loader import load_stage_weights
from pp_runtime.model.transformer import StageModel
from pp_runtime.parallel.groups import StageGroups
from pp_runtime.parallel.layers import TensorParallel, Unsharded
from pp_runtime.parallel.p2p import StageLink
from pp_runtime.sampling import sample


class StageWorker:
    def __init__(self, cfg: Config, stage: int, device: torch.device,
                 checkpoint: str | Path | None = None, groups: StageGroups | None = None):
        m = cfg.model
        self.cfg, self.stage, self.device = cfg, stage, device
        self.tp_rank = groups.tp_rank if groups else 0
        self.lo, self.hi = stage_layers(m.num_layers, cfg.parallel.pp, stage)
        dtype = torch_dtype(m.dtype)
        par = (Unsharded() if groups is None
               else TensorParallel(groups.tp_group, groups.tp, groups.tp_rank, dtype))
        with torch.device(device):
            model = StageModel(m, self.lo, self.hi, par)
        model.to(dtype)
        if checkpoint is None:
            model.init_random(cfg.runtime.seed)
        else:
            load_stage_weights(model, checkpoint)
        self.model = model.eval().requires_grad_(False)
        self.cache = KVCache.for_stage(cfg, self.hi - self.lo, dtype, device)
        self.link = StageLink(groups, m.hidden_size, dtype, device) if groups and groups.pp > 1 else None

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
    def execute(self, mb: MicroBatch, x: torch.Tensor | None = None):
        """Returns (hidden states, timing) on inner stages and (SampledTokens, timing) on
        the last stage; with process groups the hidden states have already been sent on."""
        wait_s = transfer_s = 0.0
        if self.link is not None and not self.model.is_first:
            x, wait_s, transfer_s = self.link.recv(mb)
        start = now(self.device)
        hidden, layout = self.forward(mb, x)
        out = hidden
        if self.is_last:
            seqs = [s for s in mb.seqs if s.sampling is not None]
            logits = self.model.logits(hidden[layout.sample_rows])  # [num_sampling, vocab]
            tokens = {}
            if self.tp_rank == 0:  # every rank holds the same logits; one samples
                ids = sample(logits, [s.sampling for s in seqs], [s.kv_len for s in seqs])
                tokens = {s.request_id: t for s, t in zip(seqs, ids)}
            out = SampledTokens(mb.mb_id, tokens)
        end = now(self.device)
        send_wait_s = 0.0
        if self.link is not None and not self.is_last:
            send_wait_s = self.link.send(mb, hidden)
        return out, StageTiming(mb.mb_id, self.stage, self.tp_rank, wait_s, transfer_s, start, end,
                                send_wait_s)
