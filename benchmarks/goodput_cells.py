"""One goodput cell climbed on the rate grid: `uniform` at its defaults and Sarathi-Serve at
the given chunks, each from rate `start` up the x1.1 grid until it misses, with
benchmarks/goodput.py's probes (its `Setting`: targets, probe length, rates up to the work
bound). For a cell's capacities above a point already known, without the whole setting.

    python benchmarks/goodput_cells.py MODEL REQUESTS PD TBT_MULTIPLE START [CHUNKS]
    python benchmarks/goodput_cells.py gpt3 1000 1 3 3.313 128
"""
from __future__ import annotations

import argparse
import math
import time

from tqdm import tqdm

import goodput as g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(g.MODELS))
    ap.add_argument("requests", type=int, help="N: the fewest requests a probe holds")
    ap.add_argument("pd", type=float, help="prompt : decode ratio")
    ap.add_argument("multiple", type=float, help="TBT target as a multiple of the unloaded TBT")
    ap.add_argument("start", type=float, help="first rate probed (req/s; the grid point nearest)")
    ap.add_argument("chunks", nargs="?", default="", help="Sarathi-Serve chunk sizes, e.g. 128,256")
    a = ap.parse_args()
    model, N, PD, MULT, start = a.model, a.requests, a.pd, a.multiple, a.start
    chunks = [int(c) for c in a.chunks.split(",") if c]
    st = g.Setting(g.MODELS[model], N, PD, tqdm(disable=True))
    slo = MULT * st.tbt_unloaded
    print(f"{model} P:D {PD:g} {MULT:g}x: TBT target {slo*1e3:.1f} ms, TTFT target {st.ttft_slo:.3f} s, work bound {st.bound:.3f} req/s, SLO bound {min(st.bound, g.slo_bound(st.cost, st.wl, st.pp, slo)):.3f}", flush=True)
    k0 = round(math.log(start / g.RATE0) / math.log(g.GRID_STEP))
    rows = [("uniform", {"tbt_slo_ms": slo * 1e3, "ttft_slo_ms": st.ttft_slo * 1e3})] + [("sarathi-serve", {"chunk_size": c}) for c in chunks]
    for planner, knobs in rows:
        best = None
        for k in range(k0, st.top + 1):
            q = round(g.RATE0 * g.GRID_STEP ** k, 6)
            t0 = time.time()
            r = st.run(planner, knobs, q)
            ok = st.ok(r, slo)
            print(f"  {planner} {knobs.get('chunk_size', '')} {q:.3f} req/s ({r['requests']} requests): {'ok' if ok else 'MISS'} tbt p99 {r['tbt_p99']*1e3:.1f} ms ttft p99 {r['ttft_p99']:.3f} s bubble {r['bubble']:.2%} ({time.time()-t0:.0f} s)", flush=True)
            if not ok:
                break
            best = q
        print(f"  => {planner} {knobs.get('chunk_size', '')}: capacity {best}", flush=True)


if __name__ == "__main__":
    main()
