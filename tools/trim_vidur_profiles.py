#!/usr/bin/env python3
"""Regenerate `pp_runtime/costmodel/data/` from the Vidur profiles (MIT licence).

    python tools/trim_vidur_profiles.py [--src /work/shared/data/vidur-profiles]
                                        [--out pp_runtime/costmodel/data]

Keeps only the key columns and the `time_stats.OP.median` columns (milliseconds), averages
rows measured twice at the same point, drops token counts the cost model never looks up
(network tables: above 32768 tokens), and writes a README naming the source of every file.
Standard library only: the machines that run it need no pandas.
"""
from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

MLP_KEYS = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
            "num_tensor_parallel_workers", "num_tokens"]
MLP_OPS = ["emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]
ATTN_KEYS = ["n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size",
             "prefill_chunk_size", "kv_cache_size", "is_prefill"]
ATTN_OPS = ["attn_prefill", "attn_decode"]
MAX_NET_TOKENS = 32768  # network tables go to 200K tokens; a micro-batch never does
HISTORY = "vidur_history_a100_h100"
MAIN = "vidur_main_7d47513"


def read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def median(op: str) -> str:
    return f"time_stats.{op}.median"


def merge(rows: list[dict[str, str]], keys: list[str], ops: list[str]) -> list[list[str]]:
    """One output row per key: the mean of the medians of duplicate rows ('' = not measured)."""
    acc: dict[tuple, list[list[float]]] = {}
    for r in rows:
        vals = acc.setdefault(tuple(r[k] for k in keys), [[] for _ in ops])
        for i, op in enumerate(ops):
            if r.get(median(op)):
                vals[i].append(float(r[median(op)]))
    out = [list(key) + [f"{sum(v) / len(v):.6g}" if v else "" for v in vals]
           for key, vals in acc.items()]
    return sorted(out, key=lambda row: [sortable(x) for x in row[:len(keys)]])


def sortable(x: str) -> tuple:
    try:
        return (0, float(x), "")
    except ValueError:
        return (1, 0.0, x)


def write(path: Path, header: list[str], rows: list[list[str]]) -> int:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return len(rows)


def trim_mlp(src: Path, out: Path, dev: str, notes: list[str]) -> None:
    """Linear and small ops: vidur main's per-model tables, then the history's 6 shapes for
    any (shape, vocab) main lacks. Fills post_attention_layernorm from input_layernorm where a
    model (phi-2: parallel attention) has one norm only."""
    shape = MLP_KEYS[:-1]
    main_files = sorted((src / MAIN / "compute" / dev).glob("*/*/mlp.csv"))
    rows = [r for f in main_files for r in read(f)]
    have = {tuple(r[k] for k in shape) for r in rows}
    hist_file = next((src / HISTORY).glob(f"{dev}_mlp_6shapes_*.csv"))
    extra = [r for r in read(hist_file) if tuple(r[k] for k in shape) not in have]
    for r in rows + extra:
        if not r.get(median("post_attention_layernorm")):
            r[median("post_attention_layernorm")] = r[median("input_layernorm")]
    n = write(out / f"{dev}_mlp.csv", MLP_KEYS + [median(o) for o in MLP_OPS],
              merge(rows + extra, MLP_KEYS, MLP_OPS))
    used = [str(f.relative_to(src)) for f in main_files] + ([str(hist_file.relative_to(src))]
                                                           if extra else [])
    notes.append(f"| `{dev}_mlp.csv` | {n} | {', '.join(f'`{u}`' for u in used)} |")


def trim_attention(src: Path, out: Path, notes: list[str]) -> None:
    f = next((src / HISTORY).glob("a100_attention_n8192_*.csv"))
    n = write(out / "a100_attention.csv", ATTN_KEYS + [median(o) for o in ATTN_OPS],
              merge(read(f), ATTN_KEYS, ATTN_OPS))
    notes.append(f"| `a100_attention.csv` | {n} | `{f.relative_to(src)}` |")


def trim_by_nembd(src: Path, out: Path, pattern: str, name: str, workers: str, op: str,
                  notes: list[str]) -> None:
    f = next((src / HISTORY).glob(pattern))
    rows = [r for r in read(f) if int(r["num_tokens"]) <= MAX_NET_TOKENS]
    keys = ["n_embd", "num_tokens", workers]
    n = write(out / name, keys + [median(op)], merge(rows, keys, [op]))
    notes.append(f"| `{name}` | {n} | `{f.relative_to(src)}` (num_tokens <= {MAX_NET_TOKENS}) |")


def trim_by_size(src: Path, out: Path, dev: str, op: str, notes: list[str]) -> None:
    f = src / MAIN / "network" / f"{dev}_dgx" / f"{op}.csv"
    keys = ["num_workers", "devices_per_node", "size"]
    n = write(out / f"{dev}_{op}.csv", keys + [median(op)], merge(read(f), keys, [op]))
    notes.append(f"| `{dev}_{op}.csv` | {n} | `{f.relative_to(src)}` (size in bytes) |")


README = """# Shipped operation profiles (from the Vidur project, MIT licence)

Measured on real GPUs by the authors of the Vidur simulator (microsoft/vidur, MIT licence:
`LICENSE_vidur_MIT.txt`). Times are milliseconds, the median of repeated runs; rows
measured twice were averaged. Regenerate with `python tools/trim_vidur_profiles.py`
(from a copy of the full tables; see `docs/costmodel.md` for how each table is used).

| file | rows | from |
| --- | --- | --- |
{rows}

- `*_mlp.csv`: per-layer ops by token count and TP degree (vidur main's per-model tables;
  the history's `*_mlp_6shapes_*.csv` hold the same six shapes, an older measurement, and
  are used only for a shape main lacks: none today); `mlp_up_proj` of a gated model
  is the fused gate+up matmul (2 x n_expanded_embd wide). `add` is empty where it was not
  measured; phi-2's missing `post_attention_layernorm` was filled from `input_layernorm`.
- `a100_attention.csv`: FlashAttention kernels for 64 query / 8 KV heads of head dim 128 at
  TP 2. Prefill rows: a chunk of `prefill_chunk_size` tokens with `kv_cache_size` tokens
  already in the cache before it (chunk + cache <= 4096). Decode rows: `batch_size`
  sequences with `kv_cache_size` tokens cached each (a decode attends to those + itself).
- `a100_send_recv_*`, `a100_all_reduce.csv`: activations of `num_tokens` x `n_embd` fp16;
  a send with TP degree t moves one rank's 1/t slice.
- `h100_*`: NCCL collectives on a DGX H100 by message size in bytes;
  `devices_per_node` = 1 is a send across nodes, 2 inside a node.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=Path("/work/shared/data/vidur-profiles"))
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "pp_runtime/costmodel/data")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    for dev in ("a100", "h100"):
        trim_mlp(args.src, args.out, dev, notes)
    trim_attention(args.src, args.out, notes)
    trim_by_nembd(args.src, args.out, "a100_all_reduce_by_nembd_*.csv", "a100_all_reduce.csv",
                  "num_workers", "all_reduce", notes)
    for where in ("inter", "intra"):
        trim_by_nembd(args.src, args.out, f"a100_p2p_{where}_node_by_nembd_*.csv",
                      f"a100_send_recv_{where}_node.csv", "num_tensor_parallel_workers",
                      "send_recv", notes)
    for op in ("all_reduce", "send_recv"):
        trim_by_size(args.src, args.out, "h100", op, notes)
    shutil.copyfile(args.src / "LICENSE_vidur_MIT.txt", args.out / "LICENSE_vidur_MIT.txt")
    (args.out / "README.md").write_text(README.replace("{rows}", "\n".join(notes)))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
