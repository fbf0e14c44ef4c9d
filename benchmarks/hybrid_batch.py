"""Decode-maximal batching on this machine (the paper's Table 2, on a CPU).

Times one stage holding a whole GPT-2-small-shaped model (random weights, fp32, 1 thread)
on three micro-batches, side by side in one run:
  prefill-only  a chunk of C prompt tokens (at position 512, so it attends to 512 + C keys)
  decode-only   D decodes, each attending to ~1K keys
  hybrid        a tile-aligned chunk of C - D tokens and the D decodes fused into one
                micro-batch of C tokens (paper §4.4)
and prints per-token costs and the ratios that show decodes riding along almost free.

    python benchmarks/hybrid_batch.py [--chunk 256] [--decodes 8] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk, slot_tables
from pp_runtime.config import Config
from pp_runtime.worker.stage import StageWorker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000, help="KV length of the decodes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = Config().with_overrides(kv_slots=args.decodes + 1)  # GPT-2 small shapes
    worker = StageWorker(cfg, 0, torch.device("cpu"))
    for k, v in zip(worker.cache.k, worker.cache.v):  # pretend every slot holds a long context
        k.normal_()
        v.normal_()
    greedy = Sampling(0.0, 1.0, 0)
    chunk = SeqChunk(0, args.decodes, 512, tuple(range(args.chunk)), greedy)
    aligned = SeqChunk(0, args.decodes, 512, tuple(range(args.chunk - args.decodes)), greedy)
    decodes = tuple(SeqChunk(i + 1, i, args.context, (7,), greedy, is_decode=True)
                    for i in range(args.decodes))
    batches = {"prefill-only": (chunk,), "decode-only": decodes, "hybrid": decodes + (aligned,)}

    def timed(seqs) -> float:
        mb = MicroBatch(0, slot_tables(seqs, -(-cfg.seq_len // cfg.cache.block_size)))
        worker.execute(mb)  # warm-up
        samples = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            worker.execute(mb)
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1e3

    ms = {name: timed(seqs) for name, seqs in batches.items()}
    print(f"GPT-2 small shapes, fp32, {args.threads} thread(s), median of {args.repeats}; "
          f"chunk {args.chunk} tokens, {args.decodes} decodes at ~{args.context} keys")
    print(f"{'batch':>13} {'ms':>8} {'per prefill tok':>16} {'per decode tok':>15}")
    print(f"{'prefill-only':>13} {ms['prefill-only']:8.1f} {ms['prefill-only'] / args.chunk:16.3f} {'-':>15}")
    print(f"{'decode-only':>13} {ms['decode-only']:8.1f} {'-':>16} {ms['decode-only'] / args.decodes:15.3f}")
    per_prefill = ms["prefill-only"] / args.chunk
    extra = ms["hybrid"] - per_prefill * (args.chunk - args.decodes)  # what the decodes add
    print(f"{'hybrid':>13} {ms['hybrid']:8.1f} {per_prefill:16.3f} {extra / args.decodes:15.3f}"
          f"   (prefill tokens priced as prefill-only; decodes get the rest)")
    separate = ms["prefill-only"] * (args.chunk - args.decodes) / args.chunk + ms["decode-only"]
    print(f"hybrid / same tokens run separately = {ms['hybrid'] / separate:.2f}")
    print(f"decode cost per token, decode-only / piggybacked = {ms['decode-only'] / max(extra, 1e-9):.1f}x")


if __name__ == "__main__":
    main()
