"""A stage worker: one (pipeline stage, TP rank) shard of the model and its KV cache.

`execute(mb, x)` runs the stage's layers over every token of a micro-batch. Stage 0 takes
the token ids from the plan itself; other stages take the previous stage's hidden states:
in memory from the in-process executor (`x`), or over torch.distributed when the worker
has process groups (each TP rank receives its 1/tp slice from the same TP rank of the
previous stage and all-gathers it, `parallel/p2p.py`). The last stage computes logits only
for the rows that sample, gathers them over the vocabulary and samples (TP rank 0 returns
the token ids). With the token hop (`runtime.token_hop`, `parallel/p2p.TokenHop`) the
last stage also sends the ids straight to stage 0, which fills the plan's placeholder
decodes with them before embedding. Each call records a `StageTiming`: wait, transfer, compute, and the
time blocked before its send (the next stage had not taken the previous one), as spans
of the worker's timer (`telemetry/timer.py`: perf_counter on CPU, CUDA events on a GPU).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from pp_runtime.core.batch import MicroBatch, RankResult, StageTiming, fill_placeholders, sampling_ids
from pp_runtime.config import Config
from pp_runtime.core.errors import ConfigError
from pp_runtime.worker.device import torch_dtype
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.costmodel.memory import check_stage_fits
from pp_runtime.model.attention import BatchLayout
from pp_runtime.model.cpu_kernels import prepack_linears, use_decode_kernel, use_prepack
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.model.paged_kernel import use_paged_decode
from pp_runtime.model.loader import load_stage_weights
from pp_runtime.model.transformer import ShapesOnly, StageModel, compile_small_ops, materialize
from pp_runtime.parallel.groups import StageGroups
from pp_runtime.parallel.layers import TensorParallel, Unsharded
from pp_runtime.parallel.p2p import StageLink, TokenHop
from pp_runtime.worker.graphs import DecodeGraphs
from pp_runtime.worker.sampling import sample
from pp_runtime.telemetry.timer import Op, Timer, device_timer


class StageWorker:
    def __init__(self, cfg: Config, stage: int, device: torch.device,
                 checkpoint: str | Path | None = None, groups: StageGroups | None = None):
        cfg = resolve_layer_split(cfg)  # an auto split chosen alike wherever it is built
        m = cfg.model
        self.cfg, self.stage, self.device = cfg, stage, device
        self.tp_rank = groups.tp_rank if groups else 0
        self.lo, self.hi = cfg.stage_layers(stage)  # parallel.layer_split, resolved
        dtype = torch_dtype(m.dtype_for(device.type))  # "auto": the checkpoint's on a GPU
        check_stage_fits(cfg, stage, self.tp_rank, dtype.itemsize, device)  # before allocating
        # tp = 1 needs no collectives: plain torch layers (which `prepack_linears` packs)
        par = (Unsharded() if groups is None or groups.tp == 1
               else TensorParallel(groups.tp_group, groups.tp, groups.tp_rank, dtype))
        with torch.device("meta"), ShapesOnly():  # each tensor is allocated once, below
            model = StageModel(m, self.lo, self.hi, par, cfg.stage_units(stage))
        materialize(model, device, dtype)  # this rank's shard, in its final dtype
        if checkpoint is None:
            model.init_random(cfg.runtime.seed)  # draws only this rank's shard
        else:
            load_stage_weights(model, checkpoint)  # reads only this rank's slices
        if use_prepack(cfg, device):  # after loading: packing drops the dense weights
            prepack_linears(model)
        self.cpu_decode = use_decode_kernel(cfg, device)  # built now, not in the first micro-batch
        self.paged = use_paged_decode(cfg, device)
        self.model = model.eval().requires_grad_(False)
        small = cfg.runtime.compile_small_ops
        compile_small_ops(small is True or (small == "auto" and device.type == "cuda"))
        self.cache = KVCache.for_stage(cfg, model.num_attention, dtype, device)
        self.graphs = self._graphs(groups, dtype)
        self.link = StageLink(groups, m.hidden_size, dtype, device) if groups and groups.pp > 1 else None
        # every rank creates the hop's group, in the same order (torch.distributed's rule)
        self.hop = (TokenHop(groups, device, cfg.in_flight, cfg.runtime.step_timeout_s)
                    if self.link is not None and cfg.runtime.token_hop is True else None)
        self.timer: Timer = device_timer(device)  # times every call (CUDA: anchored once here)

    def _graphs(self, groups: StageGroups | None, dtype: torch.dtype) -> DecodeGraphs | None:
        """CUDA graphs for decode-only micro-batches (`runtime.cuda_graphs`): auto on CUDA at
        tp = 1 when decode attention reads the block tables from tensors (paged); true on
        a CPU runs the graphs' static buffers uncaptured, with the C++ decode kernel."""
        rt, tp = self.cfg.runtime, groups.tp if groups else 1
        tables_in_tensors = self.paged or self.cpu_decode
        on = (rt.cuda_graphs is True or (rt.cuda_graphs == "auto" and self.device.type == "cuda"))
        if not on or tp > 1 or not tables_in_tensors:
            if rt.cuda_graphs is True and (tp > 1 or not tables_in_tensors):
                raise ConfigError("runtime.cuda_graphs: true needs tp = 1 and decode attention "
                                  "that reads block tables from tensors (paged on CUDA, the C++ "
                                  "kernel on a CPU); use auto or false")
            return None
        bs = self.cfg.cache.block_size
        return DecodeGraphs(self.model, self.cache, bs, rt.graph_max_decodes,
                            -(-self.cfg.seq_len // bs), dtype, self.device,
                            capture=self.device.type == "cuda", cpu_decode=self.cpu_decode,
                            paged=self.paged)

    def close_hop(self) -> None:
        """A clean shutdown: the token hop's messages still due are taken (`TokenHop.close`)."""
        if self.hop is not None:
            self.hop.close()

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @torch.inference_mode()
    def forward(self, mb: MicroBatch, x: torch.Tensor | None) -> tuple[torch.Tensor, BatchLayout]:
        """Hidden states [num_tokens, hidden] after this stage's layers."""
        layout = BatchLayout.build(mb, self.device, self.cfg.cache.block_size, self.cpu_decode,
                                   self.paged, ids=self.model.is_first)
        if self.model.is_first:
            x = layout.token_ids  # [num_tokens], in the layout's one copy
        return self.model(x, self.cache, layout), layout

    @torch.inference_mode()
    def compute(self, mb: MicroBatch, x: torch.Tensor | None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden states [num_tokens, hidden] for the next stage, or None on the last;
        logits [num_sampling, vocab] on the last stage, else None): from a CUDA graph for a
        decode-only micro-batch that fits one (`worker/graphs.py`), else eagerly."""
        bucket = self.graphs.bucket(mb) if self.graphs is not None else None
        if bucket is not None:
            y = self.graphs.run(mb, x, bucket)
            return (None, y) if self.is_last else (y, None)
        hidden, layout = self.forward(mb, x)
        if self.is_last:
            return None, self.model.logits(hidden[layout.sample_rows])  # [num_sampling, vocab]
        return hidden, None

    @torch.inference_mode()
    def execute(self, mb: MicroBatch, x: torch.Tensor | None = None
                ) -> tuple[RankResult, torch.Tensor | None]:
        """(this rank's result, the hidden states [num_tokens, hidden] for the next stage,
        None on the last stage); with process groups they have already been sent on.

        Timing: spans RECV_WAIT, TRANSFER (`link.recv`), COMPUTE, SEND_WAIT (`link.send`).
        On CUDA nothing waits while they are recorded; `resolve()` at the end waits for
        this stream's last span only (never for the send just posted, which runs on NCCL's
        stream), so the call's own timing comes back with it and none is held over."""
        rec = self.timer.record()
        hop, token_wait = self.hop, 0.0
        if hop is not None and hop.receives:  # outside every span: a wait for a token is a
            held = time.perf_counter()        # dependency bubble (telemetry/bubbles.py)
            hop.before(mb.mb_id)
            mb = fill_placeholders(mb, hop.token)
            token_wait = time.perf_counter() - held
        if self.link is not None and not self.model.is_first:
            x = self.link.recv(mb, rec)
        with rec.span(Op.COMPUTE):
            out, logits = self.compute(mb, x)
            tokens = None
            if self.is_last:
                seqs = [s for s in mb.seqs if s.sampling is not None]
                if self.tp_rank == 0:  # every rank holds the same logits; one samples
                    ids = sample(logits, [s.sampling for s in seqs], [s.kv_len for s in seqs])
                    tokens = {s.request_id: t for s, t in zip(seqs, ids)}
                    if hop is not None and ids:
                        hop.send(mb.mb_id, list(ids))
        if hop is not None and hop.receives:
            hop.expect(mb.mb_id, sampling_ids(mb))
        if self.link is not None and not self.is_last:
            self.link.send(mb, out, rec)
        spans = rec.resolve()
        if self.link is not None:
            self.link.check_headers()
        start, end = spans[Op.COMPUTE]
        timing = StageTiming(mb.mb_id, self.stage, self.tp_rank, spans.seconds(Op.RECV_WAIT),
                             spans.seconds(Op.TRANSFER), start, end, spans.seconds(Op.SEND_WAIT),
                             token_wait)
        return RankResult(timing, tokens), out
