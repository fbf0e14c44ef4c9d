"""What each CPU lever buys one stage: time per micro-batch, split into linear layers,
attention, the LM head and the rest (host work: layout, embedding, norms, activations,
sampling), side by side in one run.

One worker per lever set holds a whole GPT-2-small-shaped model (random weights, one
stage, fp32 unless the set says otherwise), its KV cache filled with random keys; the
sets take turns on the same micro-batches, `--repeats` rounds, and the median of each is
printed. The micro-batches are the two the cpu/gpt2_pp2 workload is made of:
  decode   --decodes decodes, each attending to --context keys
  hybrid   a chunk of --chunk - --decodes prompt tokens (at position --context) and the
           same decodes, in one micro-batch

    python benchmarks/stage_levers.py [--threads 1] [--repeats 5] [--out runs/stage_levers]

The sets switch `runtime.prepack` (oneDNN-packed linear weights), `runtime.kv_layout`
(heads-major KV cache) and `runtime.cpu_decode_kernel` (every decode in one C++ call per
layer) on one at a time, then all three, then all three in bfloat16 (an option on CPUs
with AVX-512 bf16; fp32 stays the default).

Then the paged cache's cost on prefill (`paged_prefill`): the chunk's attention over its
blocks scattered through the pool (gathered once per layer), against the contiguous path
the cache had before paging (one slot per request, SDPA on a view of it, no copy), on the
same keys, for each cache order; the difference is also given as a share of the whole
hybrid micro-batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk, slot_blocks
from pp_runtime.config import Config
from pp_runtime.model import attention, transformer
from pp_runtime.model.cpu_kernels import PackedLinear
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.worker.stage import StageWorker

LEVERS = {  # name -> config overrides
    "baseline": {"prepack": False, "kv_layout": "tokens", "cpu_decode_kernel": False},
    "+prepack": {"prepack": True, "kv_layout": "tokens", "cpu_decode_kernel": False},
    "+kv heads": {"prepack": False, "kv_layout": "heads", "cpu_decode_kernel": False},
    "+decode kernel": {"prepack": False, "kv_layout": "tokens", "cpu_decode_kernel": True},
    "all": {"prepack": True, "kv_layout": "heads", "cpu_decode_kernel": True},
    "all bf16": {"prepack": True, "kv_layout": "heads", "cpu_decode_kernel": True,
                 "dtype": "bfloat16"},
}
PARTS = ("linear", "attention", "lm_head", "other")


class Split:
    """Seconds per part of one `execute`, by wrapping the forwards of the parts."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0  # the LM head is a linear layer: count it once, as lm_head

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t
                self.depth -= 1
        return timed


CURRENT: list[Split] = []  # the split of the worker executing now


def _attention(*args, **kwargs):
    """`hybrid_attention` as the model calls it (a module-level function), timed."""
    return CURRENT[-1].wrap("attention", attention.hybrid_attention)(*args, **kwargs)


def instrument(worker: StageWorker, split: Split) -> None:
    transformer.hybrid_attention = _attention
    for m in worker.model.modules():
        if isinstance(m, (nn.Linear, PackedLinear)) and m is not getattr(worker.model, "lm_head", None):
            m.forward = split.wrap("linear", m.forward)
    worker.model.logits = split.wrap("lm_head", worker.model.logits)


def batches(args) -> dict[str, MicroBatch]:
    greedy = Sampling(0.0, 1.0, 0)
    per = 1024 // args.block_size  # blocks of one 1024-token context (max_seq_len)
    decodes = tuple(SeqChunk(i, slot_blocks(i, per), args.context - 1, (7,), greedy,
                             is_decode=True) for i in range(args.decodes))
    chunk = SeqChunk(args.decodes, slot_blocks(args.decodes, per), args.context,
                     tuple(range(args.chunk - args.decodes)), None)
    return {"decode": MicroBatch(0, decodes), "hybrid": MicroBatch(1, (chunk, *decodes))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--context", type=int, default=600, help="KV length of the decodes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16, help="cache.block_size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--out", default="runs/stage_levers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = Config().with_overrides(kv_slots=args.decodes + 1, max_seq_len=1024,
                                   block_size=args.block_size)
    workers, splits = {}, {}
    for name in args.levers:
        if "bf16" in name and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print(f"{name}: skipped, this CPU has no AVX-512 bf16")
            continue
        w = StageWorker(base.with_overrides(**LEVERS[name]), 0, torch.device("cpu"))
        for k, v in zip(w.cache.k, w.cache.v):  # every slot holds a long context
            k.normal_()
            v.normal_()
        workers[name], splits[name] = w, Split()
        instrument(w, splits[name])
    mbs = batches(args)
    times = {(n, k): defaultdict(list) for n in workers for k in mbs}
    for _ in range(args.repeats + 1):  # the first round warms up
        for kind, mb in mbs.items():
            for name, w in workers.items():
                split = splits[name]
                split.seconds.clear()
                CURRENT[:] = [split]
                t = time.perf_counter()
                w.execute(mb)
                total = time.perf_counter() - t
                parts = dict(split.seconds)
                parts["other"] = total - sum(parts.values())
                for part, s in (*parts.items(), ("total", total)):
                    times[name, kind][part].append(s)
    rows = []
    print(f"one stage = GPT-2 small (12 layers + LM head), {args.threads} thread(s); median of "
          f"{args.repeats}; ms per micro-batch")
    print(f"{'micro-batch':<34} {'levers':<14} {'total':>8} {'linear':>8} {'attention':>9} "
          f"{'lm_head':>8} {'other':>7} {'speed-up':>8}")
    for kind, mb in mbs.items():
        label = (f"decode: {args.decodes} x {args.context} keys" if kind == "decode" else
                 f"hybrid: chunk {args.chunk - args.decodes} + {args.decodes} decodes")
        first = None
        for name in workers:
            med = {p: statistics.median(v[1:]) * 1e3 for p, v in times[name, kind].items()}
            first = first or med["total"]
            rows.append({"micro_batch": kind, "levers": name, **LEVERS[name], **med})
            print(f"{label:<34} {name:<14} {med['total']:8.2f} {med.get('linear', 0):8.2f} "
                  f"{med.get('attention', 0):9.2f} {med.get('lm_head', 0):8.2f} "
                  f"{med['other']:7.2f} {first / med['total']:7.2f}x")
    hybrid_ms = {r["levers"]: r["total"] for r in rows if r["micro_batch"] == "hybrid"}
    paged = paged_prefill(args, hybrid_ms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage_levers.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                       "paged_prefill": paged}, indent=1))
    print(f"wrote {out / 'stage_levers.json'}")


def contiguous_prefill_attention(q, k_slot, v_slot, start):
    """The prefill attention before paging: the request's slot [seq_len, kv_heads, head_dim]
    read as a view (no copy). q: [n, heads, head_dim]."""
    n = q.shape[0]
    kv_len = start + n
    k = k_slot[:kv_len].transpose(0, 1)[None]  # [1, kv_heads, kv_len, head_dim], a view
    v = v_slot[:kv_len].transpose(0, 1)[None]
    mask = causal_lower_right(n, kv_len)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)


def paged_prefill(args, hybrid_ms: dict[str, float]) -> list[dict]:
    """ms for the attention of one prefill chunk over 12 layers: paged (scattered blocks,
    gathered) against the old contiguous slot (a view), same keys, each cache order."""
    n, start, bs, layers = args.chunk - args.decodes, args.context, 16, 12
    kv_len, heads, dim = start + n, 12, 64
    nb = -(-kv_len // bs)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(4 * nb, generator=g)[:nb]  # scattered through a pool of 4 contexts
    q = torch.randn(n, heads, dim, generator=g)
    print(f"\npaged prefill: attention of a {n}-token chunk at position {start} "
          f"({kv_len} keys, blocks of {bs} scattered), {layers} layers, median of {args.repeats}")
    rows = []
    for layout in ("tokens", "heads"):
        slots = [torch.randn(kv_len, 12, dim, generator=g) for _ in range(2 * layers)]
        pool = []
        for t in slots:  # the same keys, in blocks of the paged pool (the worker's layout)
            blocks = KVCache(1, 4 * nb, bs, 12, dim, torch.float32, torch.device("cpu"),
                             heads_major=layout == "heads").k[0]
            padded = torch.cat([t, torch.zeros(nb * bs - kv_len, 12, dim)])
            blocks[table] = padded.view(nb, bs, 12, dim)
            pool.append(blocks)
        if layout == "heads":  # the old heads-major slot: [kv_heads, seq, dim], shown permuted
            slots = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in slots]
        span = attention.PrefillSpan(slice(0, n), table, start)
        old_fn = lambda: [contiguous_prefill_attention(q, slots[2 * i], slots[2 * i + 1], start)  # noqa: E731
                          for i in range(layers)]
        new_fn = lambda: [attention.prefill_attention(q, pool[2 * i], pool[2 * i + 1], span)  # noqa: E731
                          for i in range(layers)]
        torch.testing.assert_close(new_fn()[0], old_fn()[0], atol=1e-5, rtol=1e-5)
        times = {"contiguous": [], "paged": []}
        for _ in range(args.repeats + 1):
            for name, fn in (("contiguous", old_fn), ("paged", new_fn)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        old, new = (statistics.median(times[k][1:]) * 1e3 for k in ("contiguous", "paged"))
        hybrid = hybrid_ms.get("all") or next(iter(hybrid_ms.values()), None)
        share = f", {(new - old) / hybrid * 100:+.1f} % of a hybrid micro-batch ({hybrid:.1f} ms)" \
            if hybrid else ""
        print(f"  kv_layout {layout:6s}: contiguous {old:7.2f} ms, paged {new:7.2f} ms, "
              f"paged / contiguous {new / old:.3f}{share}")
        rows.append({"kv_layout": layout, "contiguous_ms": old, "paged_ms": new,
                     "hybrid_ms": hybrid})
    return rows


if __name__ == "__main__":
    main()
