"""What `pp-runtime run` checks and prints before and while it runs: its base config, the
one-line description of what starts, its prompt arguments (checked before any worker
starts), one line per micro-batch, and the KV cache's size."""
from __future__ import annotations

from pathlib import Path

from pp_runtime.config import Config, ConfigError, load_config
from pp_runtime.memory import kv_blocks
from pp_runtime.request import SamplingParams


def describe_microbatch(mb, out) -> str:
    """One line: the first prefill chunk (and how many more were packed beside it), the
    decodes and their KV lengths, the tokens, and the stage-time sum of TP rank 0."""
    prefill = [s for s in mb.seqs if not s.is_decode]
    decodes = [s for s in mb.seqs if s.is_decode]
    parts = [f"mb {mb.mb_id:4d}"]
    if prefill:
        s = prefill[0]
        more = f" +{len(prefill) - 1} packed" if len(prefill) > 1 else ""
        parts.append(f"prefill r{s.request_id} [{s.start}:{s.kv_len}) {s.num_tokens:4d} tok{more}")
    else:
        parts.append(f"{'no prefill':>24s}")
    kv = f" (kv {min(s.kv_len for s in decodes)}..{max(s.kv_len for s in decodes)})" if decodes else ""
    parts.append(f"{len(decodes):3d} decodes{kv}")
    parts.append(f"{mb.num_tokens:4d} tokens")
    parts.append(f"{sum(t.compute_s for t in out.timings if t.tp_rank == 0) * 1e3:7.1f} ms")
    return " | ".join(parts)


RUN_DEFAULT_CONFIG = "cpu/gpt2_pp2"  # `run` without --config / --checkpoint: a real pipeline
# The main job (`run` without --config / --checkpoint) has a steady state: its requests
# arrive at Poisson times at 70 % of the pipeline's capacity on the 2-core machine (the rate
# at which its busiest stage would never rest, as benchmarks/steady_state.py measures it:
# `run --qps 0 --requests 16`), so its bubble is read over the steady window apart from the
# warm-up and the tail (docs/bubbles.md, docs/steady_state.md)
MAIN_JOB_REQUESTS = 20
MAIN_JOB_QPS = 1.6  # 16 requests at once: stage 1 busy 6.91 s -> 2.32 req/s; 70 % of it


def is_main_job(args) -> bool:
    return not args.config and not args.checkpoint


def run_arrivals(args, n: int, seed: int) -> tuple[list[float] | None, float | None]:
    """(arrival times of `run`'s n requests, their rate): Poisson at --qps (default: the main
    job's rate, else all at time 0; --qps 0: all at time 0), seeded by --seed."""
    qps = args.qps if args.qps is not None else (MAIN_JOB_QPS if is_main_job(args) else None)
    if qps is not None and qps < 0:
        raise ConfigError(f"--qps: must be >= 0 (0: every request at once), got {qps}")
    if not qps:
        return None, None
    import numpy as np

    from pp_runtime.workload import poisson_arrivals
    return [float(a) for a in poisson_arrivals(np.random.default_rng(seed), qps, n)], qps


def run_base_config(args) -> Config:
    """The config `run` starts from: --config (the default 2-stage Ray pipeline without
    one; not `Config()`, which runs in this process), with the model section taken from
    --checkpoint when one is given. A checkpoint alone runs in this process (pp=1 unless
    --set pp), as LLM.from_pretrained does."""
    if args.checkpoint and not args.config:
        return with_checkpoint_model(Config(), args.checkpoint)
    return with_checkpoint_model(load_config(args.config or RUN_DEFAULT_CONFIG), args.checkpoint)


def with_checkpoint_model(cfg: Config, checkpoint: str | None) -> Config:
    """cfg with its model section read from a checkpoint's config.json (shapes, dtype auto):
    a config and a checkpoint compose like every other override; the config's other
    sections (parallel, planner, runtime, workload) are kept."""
    if not checkpoint:
        return cfg
    import dataclasses

    from pp_runtime.model.loader import model_config_from_hf, read_hf_config

    model = model_config_from_hf(read_hf_config(checkpoint), name=Path(checkpoint).name)
    return dataclasses.replace(cfg, model=model)


def has_gpus(n: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= n


def what_runs(cfg: Config, args) -> str:
    """One line, printed before anything starts: processes, where, transport, weights."""
    m, p, rt = cfg.model, cfg.parallel, cfg.runtime
    executor = rt.executor if rt.executor != "auto" else ("ray" if p.tp * p.pp > 1 else "local")
    ranks = f"{p.pp} pipeline stage{'s' if p.pp > 1 else ''}"
    ranks += f" x {p.tp} TP ranks" if p.tp > 1 else ""
    weights = f"weights from {args.checkpoint}" if args.checkpoint else "random weights"
    source = (f"config {args.config} + checkpoint {args.checkpoint}" if args.checkpoint and args.config
              else f"checkpoint {args.checkpoint}" if args.checkpoint else
              f"config {args.config}" if args.config else
              f"config {RUN_DEFAULT_CONFIG}, the default; --config default runs in this process")
    if executor != "ray":
        device = rt.device if rt.device != "auto" else ("cuda" if has_gpus(1) else "cpu")
        return f"{ranks} in this process ({device}), {m.name} shapes with {weights} [{source}]"
    if rt.ray_address is None:  # a local Ray: the executor uses GPUs if there is one per worker
        gpus = rt.device.startswith("cuda") or (rt.device == "auto" and has_gpus(p.tp * p.pp))
        threads = rt.threads_per_worker
        how = ("NCCL, one GPU each" if gpus else "gloo, CPU" + (
            f", {threads} torch thread{'s' if threads != 1 else ''} each" if threads else ""))
        where = f"127.0.0.1 ({how})"
    else:
        where = f"the Ray cluster at {rt.ray_address} (NCCL on GPUs, else gloo)"
    return (f"{ranks} as {p.tp * p.pp} Ray actor{'s' if p.tp * p.pp > 1 else ''} on {where}, "
            f"{m.name} shapes with {weights} [{source}]")


def run_prompt_args(args, seq_len: int) -> tuple[int, int, int]:
    """`run`'s requests and prompt lengths (n, shortest, longest), checked against each
    other and the context before anything starts. Unset lengths fit the context: the
    longest prompt defaults to min(600, context - max_tokens), the shortest to min(32, it);
    lengths the user gave are never clipped silently."""
    def bad(flag: str, problem: str) -> ConfigError:
        return ConfigError(f"{flag}: {problem}")
    n = args.requests if args.requests is not None else (
        MAIN_JOB_REQUESTS if is_main_job(args) else 8)
    if n < 1:
        raise bad("--requests", f"must be >= 1, got {n}")
    if args.max_tokens < 1:
        raise bad("--max-tokens", f"must be >= 1, got {args.max_tokens}")
    problems = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p).problems()
    if problems:
        raise bad("--temperature/--top-p", problems[0])
    room = seq_len - args.max_tokens  # positions left for a prompt
    if room < 1:
        raise bad("--max-tokens", f"{args.max_tokens} leaves no room for a prompt in the "
                  f"{seq_len}-token context; lower it")
    hi = min(600, room) if args.max_prompt is None else args.max_prompt
    lo = min(32, hi) if args.min_prompt is None else args.min_prompt
    if lo < 1:
        raise bad("--min-prompt", f"must be >= 1, got {lo}")
    if hi < lo:
        raise bad("--max-prompt", f"{hi} is below --min-prompt {lo}")
    if hi > room:
        raise bad("--max-prompt", f"{hi} + --max-tokens {args.max_tokens} exceeds the "
                  f"{seq_len}-token context; use --max-prompt {room} or less")
    return n, lo, hi


def kv_cache_text(cfg: Config) -> str:
    """The KV cache in one phrase: blocks, tokens, and bytes over all workers."""
    m, c = cfg.model, cfg.cache
    blocks = kv_blocks(cfg)
    size = 2 * m.num_layers * blocks * c.block_size * m.kv_heads * m.head_dim * m.dtype_bytes
    kind = "paged" if c.paged else f"{cfg.num_slots} slots of {cfg.seq_len} tokens"
    return (f"KV cache {blocks} blocks x {c.block_size} tokens ({kind}) = "
            f"{size / 2**20:.0f} MiB")
