"""`pp-runtime`: the command line.

  pp-runtime run      generate on a model (built-in default: GPT-2-small shapes, random
                      weights) and print one line per micro-batch
  pp-runtime memory   the paper's batch-size formula for a config and device memory
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import yaml

from pp_runtime.config import CheckpointError, Config, ConfigError, load_config
from pp_runtime.memory import memory_plan
from pp_runtime.driver import ExecutorFailed
from pp_runtime.request import InvalidRequestError, SamplingParams


def _parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected FIELD=VALUE, e.g. --set chunk_size=64")
        key, value = pair.split("=", 1)
        out[key] = yaml.safe_load(value)  # "64" -> 64, "true" -> True, "null" -> None
    return out


def _config(args) -> Config:
    overrides = _parse_overrides(args.set)
    if args.config:
        return load_config(args.config, **overrides)
    return Config().with_overrides(**overrides) if overrides else Config()


def _describe(mb, out) -> str:
    prefill = [s for s in mb.seqs if not s.is_decode]
    decodes = [s for s in mb.seqs if s.is_decode]
    parts = [f"mb {mb.mb_id:4d}"]
    if prefill:
        s = prefill[0]
        parts.append(f"prefill r{s.request_id} [{s.start}:{s.kv_len}) {s.num_tokens:4d} tok")
    else:
        parts.append(f"{'no prefill':>24s}")
    kv = f" (kv {min(s.kv_len for s in decodes)}..{max(s.kv_len for s in decodes)})" if decodes else ""
    parts.append(f"{len(decodes):3d} decodes{kv}")
    parts.append(f"{mb.num_tokens:4d} tokens")
    parts.append(f"{sum(t.compute_s for t in out.timings) * 1e3:7.1f} ms")
    return " | ".join(parts)


def cmd_run(args) -> int:
    from pp_runtime.llm import LLM  # torch is imported only by commands that need it

    t0 = time.perf_counter()
    if args.checkpoint:
        llm = LLM.from_pretrained(args.checkpoint, **_parse_overrides(args.set))
    else:
        llm = LLM(_config(args))
    cfg = llm.config
    m = cfg.model
    kv_mb = sum(w.cache.nbytes for w in llm.executor.workers) / 2**20
    print(f"model {m.name} ({m.family}, {m.num_layers} layers, hidden {m.hidden_size}, "
          f"{m.num_params() / 1e6:.1f}M params, {m.dtype}) on {llm.executor.device}, "
          f"pp={cfg.parallel.pp}, planner {cfg.planner.planner}: chunk {cfg.planner.chunk_size}, "
          f"B={cfg.planner.max_batch_size}; KV cache {cfg.num_slots} slots x {cfg.seq_len} "
          f"tokens = {kv_mb:.0f} MiB; ready in {time.perf_counter() - t0:.1f} s")
    rng = random.Random(args.seed)
    hi = min(args.max_prompt, cfg.seq_len - args.max_tokens)
    if hi < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in "
                          f"{cfg.seq_len} positions")
    prompts = [[rng.randrange(m.vocab_size) for _ in range(rng.randint(min(args.min_prompt, hi), hi))]
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    print(f"{args.requests} requests, prompts of {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens, {args.max_tokens} new tokens each")
    show = None if args.quiet else (lambda mb, out: print(_describe(mb, out), flush=True))
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, on_microbatch=show)
    elapsed = time.perf_counter() - t1
    print(f"\n{'req':>4} {'prompt':>6} {'output':>6} {'finish':>7} {'ttft_s':>7} first tokens")
    for o in outputs:
        print(f"{o.request_id:4d} {len(o.prompt_token_ids):6d} {len(o.token_ids):6d} "
              f"{o.finish_reason.value:>7} {o.first_token_s:7.2f} {o.token_ids[:8]}")
    n_out = sum(len(o.token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\n{n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s "
          f"({(n_in + n_out) / elapsed:.0f} tok/s)")
    llm.shutdown()
    return 0


def cmd_memory(args) -> int:
    cfg = _config(args)
    plan = memory_plan(cfg, args.device_memory_gb)
    print(f"{cfg.model.name}: tp={cfg.parallel.tp} pp={cfg.parallel.pp}, "
          f"utilization {cfg.cache.memory_utilization}")
    print(plan.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pp-runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--config", help="YAML config (path or shipped name); default: built-in")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field, e.g. --set chunk_size=64 (repeatable)")

    run = sub.add_parser("run", help="generate and print one line per micro-batch")
    common(run)
    run.add_argument("--checkpoint", help="Hugging Face-format model directory")
    run.add_argument("--requests", type=int, default=8)
    run.add_argument("--min-prompt", type=int, default=32)
    run.add_argument("--max-prompt", type=int, default=600)
    run.add_argument("--max-tokens", type=int, default=24)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--quiet", action="store_true", help="no per-micro-batch lines")
    run.set_defaults(func=cmd_run)

    mem = sub.add_parser("memory", help="the paper's max batch size B for a config")
    common(mem)
    mem.add_argument("--device-memory-gb", type=float, default=None,
                     help="memory of one device (default: cache.device_memory_gb of the config)")
    mem.set_defaults(func=cmd_memory)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, InvalidRequestError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ExecutorFailed as exc:
        print(f"error: the run failed, unfinished requests ended with finish reason error: {exc}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
