"""The anchors at their published defaults and at the best of their own knobs, beside
`uniform`: GPT-3 175B on A100s and LLaMA-2-70B on H100s, TP8 x PP8, at P:D 1 and 10.

Every row gets the same KV memory: the config's pp x B whole contexts of max_seq_len
(`cache.kv_slots` pinned, so raising B for an anchor does not grow its KV), as slots
(`cache.paged: false`, the SARATHI paper's) or as the same bytes in 16-token pages.

Rows (docs/baselines.md says where each comes from):
  sarathi                the SARATHI paper's planner: slots, C and B of the config
  sarathi-serve default  Sarathi-Serve @96f9911's defaults: chunk_size 512, max_num_seqs 128
  sarathi-serve best     the best of chunk_size x max_num_seqs (128, or what the pages hold)
  gllm default           gLLM @bc91d98's token throttling: maxp 8192, minp 32, iterp 8,
                         maxd 512, adaptive reserve, chunk pipelining
  gllm best              the best of a coordinate sweep: maxp, then iterp, minp, maxd
  uniform                this project's planner with its defaults (the config as shipped)
  uniform paged          the same on pages (the anchors' KV model)
  uniform best           the best of its own knobs on pages, a coordinate sweep as gLLM's:
                         chunk_size, then B (at most C: tile alignment), then in_flight
                         (pp + 1, or pp as the anchors run)
Anchors run with pp micro-batches in flight, as each system does; paged anchors with B
large enough never to bind (gLLM caps rows by maxd, Sarathi-Serve by max_num_seqs).
`÷best` is makespan over the best anchor row of the setting (a sweep row included).

    python benchmarks/anchors.py [--requests 3000] [--quick] [--pd 1,10] [--models gpt3,llama]
                                 [--out runs/anchors]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from pp_runtime.config import load_config
from pp_runtime.engine.simulate import simulate
from pp_runtime.telemetry.report import build_report, strict_json

MODELS = {"gpt3": "paper/gpt3_tp8_pp8", "llama": "paper/llama2_70b_tp8_pp8_h100"}
ROWS_B = 4096  # B for the paged anchors: never binds
SERVE_DEFAULT = {"chunk_size": 512, "cache.max_running": 128}  # sarathi/config/config.py 179-185, 246-249
GLLM_DEFAULT = {"gllm_maxp": 8192, "gllm_minp": 32, "gllm_iterp": 8, "gllm_maxd": 512}  # api_server.py 430-454
FULL = {"serve_chunk": [256, 512, 1024], "serve_seqs": [128, None],
        "gllm_maxp": [2048, 8192, 16384], "gllm_iterp": [4, 8, 16], "gllm_minp": [32, 256],
        "gllm_maxd": [128, 512], "uni_chunk": [256, 512, 1024], "uni_batch": [128, 256, 512],
        "uni_depth": ["pp"]}
QUICK = {"serve_chunk": [256, 512], "serve_seqs": [128, None], "gllm_maxp": [2048, 8192],
         "gllm_iterp": [8], "gllm_minp": [32], "gllm_maxd": [512], "uni_chunk": [256, 512],
         "uni_batch": [128], "uni_depth": ["pp"]}


class Setting:
    """One model at one P:D: runs cached by their overrides, with a progress bar."""

    def __init__(self, config: str, requests: int, pd: float, bar: tqdm):
        cfg = load_config(config)
        self.config, self.bar, self.pp = config, bar, cfg.parallel.pp
        self.base = {"workload.num_requests": requests, "workload.pd_ratio": pd,
                     "cache.kv_slots": cfg.num_slots}
        self.runs: dict[str, dict] = {}

    def run(self, planner: str, overrides: dict) -> dict:
        key = json.dumps([planner, overrides], sort_keys=True)
        if key not in self.runs:
            self.bar.set_postfix_str(f"{self.config.split('/')[-1]} {planner} {overrides}"[:70])
            cfg = load_config(self.config, planner=planner, **self.base, **overrides)
            t0 = time.perf_counter()
            s = build_report(simulate(cfg, progress=False))["summary"]
            s["sim_wall_s"] = time.perf_counter() - t0
            self.runs[key] = {"planner": planner, "overrides": overrides, "summary": s}
        self.bar.update()
        return self.runs[key]

    def anchor(self, planner: str, knobs: dict) -> dict:
        """An anchor as its system runs: pp in flight; paged with B out of the way."""
        pinned = {"in_flight": self.pp}
        if planner == "sarathi":
            return self.run(planner, {**pinned, "chunk_pipelining": False, **knobs})
        pinned.update({"cache.paged": True, "max_batch_size": ROWS_B,
                       "chunk_pipelining": planner == "gllm"})  # bc91d98 pipelines chunks
        return self.run(planner, {**pinned, **knobs})


def serve_rows(st: Setting, sweep: dict) -> tuple[dict, dict, list[dict]]:
    default = st.anchor("sarathi-serve", SERVE_DEFAULT)
    tried = [st.anchor("sarathi-serve", {"chunk_size": c, "cache.max_running": n})
             for n in sweep["serve_seqs"] for c in sweep["serve_chunk"]]
    return default, min(tried + [default], key=makespan), tried


def gllm_rows(st: Setting, sweep: dict) -> tuple[dict, dict, list[dict]]:
    """Coordinate sweep from the defaults: maxp, then iterp, minp, maxd, each kept at its
    best before the next is swept."""
    default = st.anchor("gllm", GLLM_DEFAULT)
    best, knobs, tried = default, dict(GLLM_DEFAULT), []
    for knob in ("gllm_maxp", "gllm_iterp", "gllm_minp", "gllm_maxd"):
        for value in sweep[knob]:
            r = st.anchor("gllm", {**knobs, knob: value})
            tried.append(r)
            if makespan(r) < makespan(best):
                best = r
        knobs = dict(best["overrides"])
        for k in ("in_flight", "cache.paged", "max_batch_size", "chunk_pipelining"):
            knobs.pop(k, None)
    return default, best, tried


def uniform_rows(st: Setting, sweep: dict) -> tuple[dict, list[dict]]:
    """Coordinate sweep on pages from the config's knobs: C, then B (<= C), then depth."""
    best = st.run("uniform", {"cache.paged": True})
    knobs, tried = {"cache.paged": True}, []
    for knob, values in (("chunk_size", sweep["uni_chunk"]), ("max_batch_size", sweep["uni_batch"]),
                         ("in_flight", [st.pp if v == "pp" else v for v in sweep["uni_depth"]])):
        for value in values:
            if knob == "max_batch_size" and value > knobs.get("chunk_size", 256):
                continue  # tile alignment: B - 1 decodes leave no prefill token beside them
            r = st.run("uniform", {**knobs, knob: value})
            tried.append(r)
            best = min(best, r, key=makespan)
        knobs = dict(best["overrides"])
    return best, tried


def makespan(r: dict) -> float:
    return r["summary"]["makespan_s"]


def knob_text(r: dict) -> str:
    o = r["overrides"]
    if r["planner"] == "gllm":
        return "maxp {gllm_maxp} minp {gllm_minp} iterp {gllm_iterp} maxd {gllm_maxd}".format(**o)
    if r["planner"] == "sarathi-serve":
        return f"C {o['chunk_size']}, max_num_seqs {o['cache.max_running'] or 'pages'}"
    if r["planner"] == "sarathi":
        return "C, B of the config, slots"
    if not o.get("cache.paged"):
        return "config (slots)"
    extra = ", ".join(f"{k.replace('max_batch_size', 'B').replace('chunk_size', 'C')} {v}"
                      for k, v in o.items() if k != "cache.paged")
    return "paged" + (f", {extra}" if extra else "")


HEADER = ("| row | knobs | makespan s | ÷best | bubble | TBT p50 | TBT p99 | TTFT p50 | preempt. |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def line(label: str, r: dict, best: float) -> str:
    s = r["summary"]
    return (f"| {label} | {knob_text(r)} | {s['makespan_s']:.1f} | {s['makespan_s'] / best:.3f} | "
            f"{s['bubble_fraction']:.2%} | {s['tbt_s']['median'] * 1e3:.1f} ms | "
            f"{s['tbt_s']['p99'] * 1e3:.1f} ms | {s['ttft_s']['median']:.2f} s | "
            f"{s.get('preemptions') or 0} |")


def setting_table(st: Setting, sweep: dict) -> dict:
    sar = st.anchor("sarathi", {})
    serve_default, serve_best, serve_tried = serve_rows(st, sweep)
    gllm_default, gllm_best, gllm_tried = gllm_rows(st, sweep)
    uni, uni_paged = st.run("uniform", {}), st.run("uniform", {"cache.paged": True})
    uni_best, uni_tried = uniform_rows(st, sweep)
    anchors = [sar, serve_default, serve_best, gllm_default, gllm_best]
    best = min(makespan(r) for r in anchors)
    rows = [("sarathi", sar), ("sarathi-serve default", serve_default),
            ("sarathi-serve best", serve_best), ("gllm default", gllm_default),
            ("gllm best", gllm_best), ("uniform", uni), ("uniform paged", uni_paged),
            ("uniform best", uni_best)]
    tqdm.write("\n" + HEADER)
    for label, r in rows:
        tqdm.write(line(label, r, best))
    tqdm.write(f"\nuniform ÷ best anchor: {makespan(uni) / best:.3f} (slots), "
          f"{makespan(uni_paged) / best:.3f} (paged), {makespan(uni_best) / best:.3f} (its best knobs)")
    for name, tried in (("sarathi-serve", serve_tried), ("gllm", gllm_tried), ("uniform", uni_tried)):
        distinct = {id(r): r for r in tried}.values()  # a cached run is tried once
        tqdm.write(f"sweep, makespan s: {name} " + ", ".join(
            f"[{knob_text(r)}] {makespan(r):.1f}" for r in distinct))
    return {label: r for label, r in rows} | {"uniform_over_best": makespan(uni) / best,
                                              "uniform_paged_over_best": makespan(uni_paged) / best,
                                              "uniform_best_over_best": makespan(uni_best) / best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="600 requests, a two-value sweep")
    ap.add_argument("--pd", default="1,10", help="P:D ratios, e.g. 1,3,10")
    ap.add_argument("--models", default="gpt3,llama", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--out", default="runs/anchors")
    args = ap.parse_args()
    sweep, requests = (QUICK, min(args.requests, 600)) if args.quick else (FULL, args.requests)
    models, pds = args.models.split(","), [float(x) for x in args.pd.split(",")]
    per = 6 + len(sweep["serve_chunk"]) * len(sweep["serve_seqs"]) + sum(
        len(sweep[k]) for k in ("gllm_maxp", "gllm_iterp", "gllm_minp", "gllm_maxd", "uni_chunk",
                                "uni_batch", "uni_depth"))
    out, results, t0 = Path(args.out), {}, time.perf_counter()
    with tqdm(total=per * len(models) * len(pds), unit="run", desc="anchors") as bar:
        for m in models:
            for pd in pds:
                st = Setting(MODELS[m], requests, pd, bar)
                bar.write(f"\n### {MODELS[m]}, P:D {pd:g}, {requests} requests, "
                          f"KV {st.base['cache.kv_slots']} contexts")
                results[f"{m} pd{pd:g}"] = setting_table(st, sweep)
    out.mkdir(parents=True, exist_ok=True)
    (out / "anchors.json").write_text(json.dumps(strict_json(results), indent=1))
    print(f"\nsimulated in {time.perf_counter() - t0:.0f} s; every summary in {out}/anchors.json")


if __name__ == "__main__":
    main()
