"""Does `uniform`'s TBT margin move on the simulator? Each cell of a goodput.json (written
by benchmarks/goodput.py) probed again at `uniform`'s capacity and one grid step above,
with goodput.py's own probes (its `Setting`), counting how often `TimeBudget.unplanned`
moved the margin and how low it went. The simulator's clock is exact, so a margin that
moves there is answering the plan, not jitter.

    python benchmarks/goodput_margin.py runs/goodput/goodput.json
"""
from __future__ import annotations

import argparse
import json

from tqdm import tqdm

import goodput as g
from pp_runtime.planner import budget

MOVES: list[float] = []  # the margins it moved to, this probe


def _watch() -> None:
    read = budget.TimeBudget.unplanned

    def unplanned(self, excess_s):
        before = self.margin
        read(self, excess_s)
        if self.margin != before:
            MOVES.append(self.margin)

    budget.TimeBudget.unplanned = unplanned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("goodput_json", help="a goodput.json written by benchmarks/goodput.py")
    a = ap.parse_args()
    _watch()
    for res in json.load(open(a.goodput_json)):
        config, rest = res["setting"].split(", P:D ")
        pd, requests = float(rest.split(",")[0]), int(rest.split(", ")[1].split()[0])
        st = g.Setting(g.MODELS.get(config, config), requests, pd, tqdm(disable=True))
        for cell in res["cells"]:
            slo = cell["tbt_slo_s"]
            knobs = {"tbt_slo_ms": slo * 1e3, "ttft_slo_ms": st.ttft_slo * 1e3}
            cap = cell["uniform"]["qps"]
            for qps in (cap, round(cap * g.GRID_STEP, 6)):
                MOVES.clear()
                r = st.run("uniform", knobs, qps)
                print(f"{res['setting'][:44]:44s} {cell['slo_x']}x {qps:8.3f} req/s: p99 TBT / S "
                      f"{r['tbt_p99'] / slo:.3f}, p99 TTFT / target {r['ttft_p99'] / st.ttft_slo:.3f},"
                      f" margin moved {len(MOVES)} times, lowest {min(MOVES, default=budget.MARGIN):.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
