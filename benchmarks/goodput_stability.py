"""Is the goodput ranking stable in the probe size? The capacity of `uniform` at its
defaults and of the best anchor row of `benchmarks/goodput.py` (Sarathi-Serve, chunk 128)
at each TBT target, with N and 2N requests per probe, side by side (same grid, targets,
rates up to the work bound and probe lengths as goodput.py: a probe holds at least N).

    python benchmarks/goodput_stability.py [--models gpt3] [--pd 1,10] [--requests 1000]
"""
from __future__ import annotations

import argparse

from tqdm import tqdm

from goodput import MODELS, SLO_MULTIPLES, Setting


def capacities(model: str, pd: float, n: int, chunk: int, bar: tqdm) -> dict:
    st = Setting(MODELS[model], n, pd, bar)
    out = {}
    for mult in SLO_MULTIPLES:
        slo = mult * st.tbt_unloaded
        uni = {"tbt_slo_ms": slo * 1e3, "ttft_slo_ms": st.ttft_slo * 1e3}
        out[mult] = (st.capacity("uniform", uni, slo)[0],
                     st.capacity("sarathi-serve", {"chunk_size": chunk}, slo)[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt3")
    ap.add_argument("--pd", default="1,10")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=128, help="the Sarathi-Serve row compared")
    args = ap.parse_args()
    rows = []
    with tqdm(desc="stability", unit="sim") as bar:
        for model in args.models.split(","):
            for pd in (float(x) for x in args.pd.split(",")):
                by_n = {n: capacities(model, pd, n, args.chunk, bar)
                        for n in (args.requests, 2 * args.requests)}
                rows += [(model, pd, mult, by_n) for mult in SLO_MULTIPLES]
    n1, n2 = args.requests, 2 * args.requests
    print(f"\n| setting | TBT target | uniform / sarathi-serve C {args.chunk}, req/s ({n1} requests) "
          f"| the same ({n2} requests) | ratio {n1} | ratio {n2} |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    for model, pd, mult, by_n in rows:
        (u1, s1), (u2, s2) = by_n[n1][mult], by_n[n2][mult]
        r = lambda u, s: f"{u / s:.2f}" if s else "inf"  # noqa: E731
        print(f"| {model} P:D {pd:g} | {mult}x | {u1:.3f} / {s1:.3f} | {u2:.3f} / {s2:.3f} "
              f"| {r(u1, s1)} | {r(u2, s2)} |")


if __name__ == "__main__":
    main()
