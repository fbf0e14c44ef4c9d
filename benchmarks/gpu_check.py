"""The GPU check: one command, a few minutes, on any machine with one CUDA GPU.

    python benchmarks/gpu_check.py [--out runs/gpu_check] [--quick] [--skip profile]

Sections (each runs on its own; a failure is reported and the next one runs):
  env        torch, CUDA, the GPU, which optional kernel libraries import
  hf-gpt2    our model vs Hugging Face transformers on the same random bf16 GPT-2
  hf-llama   the same for a LLaMA with grouped-query attention (8 query / 2 KV heads):
             logits of a chunked prefill (bf16 tolerance) and greedy tokens of chunked
             prefills with piggybacked decodes
  kernels    which attention kernels ran (CUDA kernel names from torch.profiler, and the
             runtime's own count of attention paths when it keeps one)
  table2     the paper's Table 2 on this GPU with LLaMA-13B layer shapes: prefill-only,
             decode-only and a decode-maximal hybrid micro-batch; per-token costs and how
             much cheaper a piggybacked decode is
  decode     decode-only micro-batches of 4 to 64 at KV 1024 against the HBM bound (weights
             and KV read once at the measured copy bandwidth): CUDA graphs + the paged
             kernel, beside the eager paged and eager gather paths
  paged-kernel  the paged decode kernel alone, by tile and warps
  timing     one stage's compute time three ways: the StageTiming the worker reports,
             CUDA events around the call, synchronize + perf_counter
  pp2        two pipeline stages on this one GPU (in one process: NCCL refuses two ranks on
             one device, so the distributed PP path cannot run here; say so)
  profile    `pp-runtime profile` on this GPU (LLaMA-2-70B shapes at TP8 per rank) priced
             beside the shipped H100 and A100 tables, operation by operation
  prefill    4 x 1024 prompt tokens against the bf16 peak an 8192^3 product reaches here,
             the small ops eager and compiled (last: the switch is process-wide)

(table2, decode, paged-kernel, prefill and timing live in gpu_speed.py beside this file.)

The summary at the end is meant to be pasted into an issue. Everything is also written
to OUT/gpu_check.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from pp_runtime import LLM, SamplingParams
from pp_runtime.core.batch import MicroBatch, SeqChunk, slot_tables
from pp_runtime.config import config_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_speed beside this file
from gpu_speed import (DEV, RESULTS, check_decode, check_paged_kernel,  # noqa: E402
                       check_prefill, check_table2, check_timing, per_slot, report)

# ---- env ---------------------------------------------------------------------------------
def check_env(args) -> None:
    if DEV[0] == "cpu":
        report("env", "INFO", f"dry run on the CPU, torch {torch.__version__}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: this check needs one")
    p = torch.cuda.get_device_properties(0)
    libs = {}
    for name in ("triton", "flash_attn", "flashinfer", "ray", "megatron.core", "transformers"):
        try:
            mod = __import__(name, fromlist=["__version__"])
            libs[name] = getattr(mod, "__version__", "yes")
        except Exception as exc:  # noqa: BLE001  absent or broken: say which
            libs[name] = f"no ({type(exc).__name__})"
    free, total = torch.cuda.mem_get_info(0)
    report("env", "INFO", f"{p.name}, {p.multi_processor_count} SMs, {total / 2**30:.1f} GiB "
           f"({free / 2**30:.1f} free), torch {torch.__version__}, CUDA {torch.version.cuda}, "
           f"bf16 {torch.cuda.is_bf16_supported()}; " + ", ".join(f"{k} {v}" for k, v in libs.items()))


# ---- ours vs transformers ----------------------------------------------------------------
def hf_model(family: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    if family == "gpt2":
        cfg = GPT2Config(n_layer=4, n_embd=256, n_head=8, vocab_size=1000, n_positions=512,
                         bos_token_id=0, eos_token_id=0, initializer_range=0.2)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                          num_key_value_heads=2, intermediate_size=512, vocab_size=1000,
                          max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                          initializer_range=0.2, rope_theta=500.0)
        model = LlamaForCausalLM(cfg)
    return model.to(device=DEV[0], dtype=dtype).eval()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (70, 23, 131, 45)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEV[0])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_hf(family: str, args) -> None:
    """bf16 is judged against fp32, beside transformers' own bf16: two bf16 implementations
    that sum in different orders differ by about as much as either differs from fp32, so
    "ours within 2x of transformers-bf16's error, both against transformers-fp32" is the
    bf16 tolerance; greedy tokens are compared the same way (how long each stays on the
    fp32 model's tokens), and ours against transformers-bf16 directly."""
    hf16 = hf_model(family)
    ref32 = hf_model(family, torch.float32)  # the same bf16-rounded weights, computed in fp32
    ref32.load_state_dict({k: v.float() for k, v in hf16.state_dict().items()})  # (RoPE's
    # inv_freq is not in the state dict: .float() of the bf16 model would keep it rounded)
    with tempfile.TemporaryDirectory() as d:
        hf16.save_pretrained(d)  # a bf16 checkpoint: dtype auto serves it in bf16 on a GPU
        llm = LLM.from_pretrained(d, device=DEV[0], chunk_size=32, max_batch_size=4,
                                  executor="local")
        worker = llm.executor.workers[0]
        dtype = next(worker.model.parameters()).dtype
        ps = prompts(ref32.config.vocab_size)
        p = ps[2]  # logits of a chunked prefill (chunks of 32 into slot 0)
        ours = []
        with torch.inference_mode():
            for start in range(0, len(p), 32):
                mb = MicroBatch(0, slot_tables([SeqChunk(0, 0, start, tuple(p[start:start + 32]),
                                                         None)], per_slot(worker.cfg)))
                hidden, _ = worker.forward(mb, None)
                ours.append(worker.model.logits(hidden).float())
            ids = torch.tensor([p], device=DEV[0])
            want, theirs = ref32(ids).logits[0].float(), hf16(ids).logits[0].float()
        got = torch.cat(ours)
        err, err_hf = ((x - want).abs().max().item() for x in (got, theirs))
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        agree_hf = (theirs.argmax(-1) == want.argmax(-1)).float().mean().item()
        report(f"hf-{family}", "PASS" if err <= 2 * err_hf + 1e-3 else "FAIL",
               f"chunked-prefill logits, ours in {dtype}: max error vs transformers-fp32 {err:.4f} "
               f"(transformers-bf16: {err_hf:.4f}); argmax equal to fp32's at {agree:.1%} of "
               f"positions (transformers-bf16: {agree_hf:.1%})")
        n = 16
        outs = llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True))
        llm.shutdown()
    ours_vs_32, hf_vs_32, ours_vs_hf = [], [], []
    for prompt, out in zip(ps, outs):
        t32, t16 = hf_greedy(ref32, prompt, n), hf_greedy(hf16, prompt, n)
        ours_vs_32.append(same_prefix(out.token_ids, t32))
        hf_vs_32.append(same_prefix(t16, t32))
        ours_vs_hf.append(same_prefix(out.token_ids, t16))
    ok = sum(ours_vs_32) >= sum(hf_vs_32) - len(ps)  # within one token per prompt
    report(f"hf-{family}", "PASS" if ok else "WARN",
           f"greedy, {n} tokens x {len(ps)} prompts, chunk 32 with piggybacked decodes: tokens "
           f"equal to transformers-fp32's for {ours_vs_32} (transformers-bf16: {hf_vs_32}); "
           f"ours vs transformers-bf16: {ours_vs_hf}")


# ---- which kernels ran --------------------------------------------------------------------
def check_kernels(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    if DEV[0] == "cpu":
        report("kernels", "INFO", "no CUDA kernels on a CPU dry run")
        return
    model = hf_model("llama")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        llm = LLM.from_pretrained(d, device=DEV[0], chunk_size=32, max_batch_size=4,
                                  executor="local")
        ps = prompts(model.config.vocab_size)
        llm.generate(ps, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(ps, SamplingParams(max_tokens=4, ignore_eos=True))
        llm.shutdown()
    names: dict[str, int] = {}
    for e in prof.key_averages():
        key = e.key.lower()
        if any(w in key for w in ("flash", "fmha", "attention", "efficient", "cudnn", "sdpa",
                                  "softmax", "paged")):
            names[e.key[:90]] = names.get(e.key[:90], 0) + e.count
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    fused = any(w in k.lower() for k, _ in top for w in ("flash", "fmha", "efficient", "cudnn", "paged"))
    report("kernels", "PASS" if fused else "WARN",
           "attention kernels: " + "; ".join(f"{k} x{c}" for k, c in top))
    try:
        from pp_runtime.model.attention import attention_paths
        from pp_runtime.worker.graphs import graph_counts
        report("kernels", "INFO", f"runtime attention paths: {attention_paths()}; "
               f"CUDA graphs: {graph_counts()}")
    except ImportError:
        report("kernels", "INFO", "the runtime keeps no count of attention paths")


# ---- two stages on one GPU -----------------------------------------------------------------
def check_pp2(args) -> None:
    model = hf_model("llama")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        ps = prompts(model.config.vocab_size)
        toks = {}
        for pp in (1, 2):
            with LLM.from_pretrained(d, device=DEV[0], chunk_size=32, max_batch_size=4,
                                     executor="local", pp=pp) as llm:
                toks[pp] = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))]
    report("pp2", "PASS" if toks[1] == toks[2] else "FAIL",
           f"pp=2 (both stages in one process on this GPU) gives the tokens of pp=1: {toks[1] == toks[2]}. "
           "Two stage processes over NCCL need two GPUs (NCCL refuses two ranks on one device); "
           "not run here.")


# ---- profile vs the shipped tables -----------------------------------------------------------
def check_profile(args) -> None:
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.profile.measure import measure_profile

    cfg = config_from_dict({"model": {"preset": "llama2-70b", "dtype": "bfloat16"},
                            "parallel": {"tp": 8, "pp": 1}, "planner": {"max_batch_size": 32},
                            "runtime": {"device": DEV[0]}})
    out = Path(args.out) / "profile-llama2-70b-tp8"
    t0 = time.perf_counter()
    measure_profile(cfg, out, quick=True, progress=False)
    took = time.perf_counter() - t0
    models = {"measured": build_cost_model(cfg.with_overrides(**{"hardware.profile": str(out)})),
              "shipped h100": build_cost_model(cfg.with_overrides(**{"hardware.gpu": "h100"})),
              "shipped a100": build_cost_model(cfg.with_overrides(**{"hardware.gpu": "a100-80gb"}))}
    lines = [f"LLaMA-2-70B shapes, one TP8 rank, measured in {took:.0f} s ({out}); ms per layer-op"]
    for label, prefills, decodes in (("256-token chunk", [(0, 256)], []),
                                     ("32 decodes at KV 1024", [], [1025] * 32)):
        b = {k: m.breakdown(prefills, decodes) for k, m in models.items()}
        lines.append(f"  {label}: op, measured, h100 table, a100 table, measured / h100")
        for op in b["measured"]:
            mv, hv, av = (b[k].get(op, 0.0) * 1e3 for k in models)
            ratio = f"{mv / hv:.2f}" if hv > 0 else "-"
            lines.append(f"    {op:<24} {mv:9.4f} {hv:9.4f} {av:9.4f}   {ratio}")
    report("profile", "INFO", "\n".join(lines))


SECTIONS = {"env": check_env, "hf-gpt2": lambda a: check_hf("gpt2", a),
            "hf-llama": lambda a: check_hf("llama", a), "kernels": check_kernels,
            "table2": check_table2, "decode": check_decode, "paged-kernel": check_paged_kernel,
            "timing": check_timing, "pp2": check_pp2,
            "profile": check_profile, "prefill": check_prefill}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--quick", action="store_true", help="fewer layers in table2")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    ap.add_argument("--only", default="", help="comma-separated sections to run")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the code paths")
    args = ap.parse_args()
    DEV[0] = args.device
    Path(args.out).mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    t0 = time.perf_counter()
    for name, fn in SECTIONS.items():
        if name in skip or (only and name not in only and name != "env"):
            continue
        try:
            fn(args)
        except SystemExit:
            raise
        except Exception as exc:  # noqa: BLE001  one section's failure must not hide the rest
            report(name, "ERROR", f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
    print(f"\n==== GPU check summary ({time.perf_counter() - t0:.0f} s) ====")
    for section, verdict, line in RESULTS:
        print(f"[{section}] {verdict}: {line}")
    Path(args.out, "gpu_check.json").write_text(json.dumps(
        [dict(section=s, verdict=v, text=t) for s, v, t in RESULTS], indent=1))
    return 1 if any(v in ("FAIL", "ERROR") for _, v, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
