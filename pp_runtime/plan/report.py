"""What `pp-runtime plan` prints, draws and writes: the ranked table, why every other layout
lost, capacity against latency for the best of each (tp, pp), and the winner's config."""
from __future__ import annotations

from pathlib import Path

import yaml

from pp_runtime.costmodel import memory
from pp_runtime.config import Config
from pp_runtime.plan.search import LOST, REL_TOL, Result, Slo
from pp_runtime.plan.space import Out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.0f} s"


def headroom(cfg: Config, lengths: list[int]) -> str:
    """KV memory per GPU and the requests it holds at the workload's mean length."""
    kv = memory.kv_capacity(cfg, lengths)
    per_block = memory.stage_memory(cfg, 0, cfg.model.dtype_bytes, slots=1).kv_bytes_per_block
    return f"{kv.blocks * per_block / memory.GB:.1f} GB KV, {kv.in_flight} req"


def rank_key(r: Result) -> tuple:
    """Best first: capacity per GPU (a grid point), then the more GPUs (at the same rate
    per GPU, more requests carried by the cluster given: GPT-3 tp4 pp8 x2 carries 10.0 req/s
    on 64 GPUs where tp4 pp12 x1 carries 7.5 on 48, and a p99 TBT 0.06 ms lower broke that
    tie before), the lower p99 TBT and TTFT, the earlier in its layout's order: the same on
    every search path."""
    d = r.detail
    return (-(r.k if r.k is not None else -10 ** 9), -r.candidate.layout.gpus,
            d.get("tbt_p99_s") or 0.0, d.get("ttft_p99_s") or 0.0, r.candidate.layout.name,
            r.order)


def layout_points(results: list[Result]) -> list[Result]:
    """Each layout's best deployment: its highest capacity, the earlier in the layout's
    search order on a tie (what both search paths know); best first (`rank_key`)."""
    best: dict = {}
    for r in results:
        if r.outcome == "searched" and r.k is not None:
            b = best.get(r.candidate.layout)
            if b is None or (r.k, -r.order) > (b.k, -b.order):
                best[r.candidate.layout] = r
    return sorted(best.values(), key=rank_key)


def ranked(results: list[Result]) -> list[Result]:
    """Searched candidates with a capacity, best first (`rank_key`)."""
    return sorted((r for r in results if r.outcome == "searched" and r.k is not None), key=rank_key)


def ranked_table(results: list[Result], configs: dict, lengths: list[int], top: int) -> str:
    rows = ranked(results)[:top]
    head = (f"{'#':>2}  {'deployment':<44} {'req/s':>7} {'/GPU':>7} {'TTFT p99':>9} "
            f"{'TBT p99':>8} {'bubble':>7} {'up/down/dep':>15}  memory")
    out = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        d, c = r.detail, r.detail.get("bubble_by_cause", {})
        causes = "/".join(f"{100 * c.get(k, 0):.1f}" for k in ("upstream", "downstream", "dependency"))
        out.append(f"{i:>2}  {r.candidate.name:<44} {r.qps:>7.3f} {r.per_gpu:>7.4f} "
                   f"{_ms(d.get('ttft_p99_s')):>9} {_ms(d.get('tbt_p99_s')):>8} "
                   f"{100 * d.get('bubble_fraction', 0):>6.1f}% {causes:>15}  "
                   f"{headroom(configs[r.candidate], lengths)}")
    return "\n".join(out)


def why_lost(r: Result, slo: Slo, best: float) -> str:
    d = r.detail
    if r.outcome == LOST:
        return f"SLO missed at {r.probes[0].qps / r.candidate.layout.gpus:.4f} req/s/GPU: {missed(d, slo)}"
    if r.outcome == "bound":
        return (f"bound: at most {r.bound_qps / r.candidate.layout.gpus:.4f} req/s/GPU without "
                f"bubbles, within {100 * REL_TOL:.0f} % of the best {best:.4f} or below")
    if r.outcome == "budget":
        return "not searched: the time budget ran out"
    if r.outcome == "error":
        return f"refused by the simulator: {d.get('error')}"
    if r.outcome == "searched" and r.k is None:
        return f"SLO: no rate probed met it ({missed(d, slo)})"
    return f"capacity {r.per_gpu:.4f} req/s/GPU, bubble {100 * d.get('bubble_fraction', 0):.1f}%"


def missed(d: dict, slo: Slo) -> str:
    """What a probe that missed missed (stopped early: what was certain then)."""
    if d.get("stopped"):
        return f"{d['stopped']} (stopped early)"
    misses = [f"{name} {_ms(d.get(key))} > {_ms(limit)}" for name, key, limit in
              (("p99 TBT", "tbt_p99_s", slo.tbt_s), ("p99 TTFT", "ttft_p99_s", slo.ttft_s))
              if d.get(key) is None or d[key] > limit]
    bubble = f", bubble {100 * d.get('bubble_fraction', 0):.1f}%" if "bubble_fraction" in d else ""
    return (", ".join(misses) or "a request failed") + bubble


def layout_table(results: list[Result], outs: list[Out], slo: Slo) -> str:
    """One line per (tp, pp, replicas): its best capacity per GPU, or why it lost."""
    points = layout_points(results)
    best = points[0].per_gpu if points else 0.0
    by_layout: dict[str, list[Result]] = {}
    for r in results:
        by_layout.setdefault(r.candidate.layout.name, []).append(r)
    lines = []
    for name, rs in by_layout.items():
        done = layout_points(rs)
        top = done[0] if done else rs[0]
        if done:
            tag = "winner" if top is points[0] else "lost"
            lines.append((-top.per_gpu, f"  {name:<14} {tag:<7} {why_lost(top, slo, best)} "
                                        f"({top.candidate.name.split(' ', 3)[3]})"))
        else:
            lines.append((0.0, f"  {name:<14} {'lost':<7} {why_lost(top, slo, best)}"))
    lines += [(1.0, f"  {o.name:<14} {'out':<7} {o.reason}: {o.detail}") for o in outs
              if o.reason in ("memory", "SLO", "cost model")]
    return "\n".join(text for _, text in sorted(lines, key=lambda x: x[0]))


def plot(results: list[Result], slo: Slo, path: Path, title: str) -> Path | None:
    """p99 TBT and p99 TTFT against the rate per GPU, one line per (tp, pp): its best."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pp_runtime.bench.capacity import latency_axis
    from pp_runtime.telemetry.plots import _save, line_styles

    best = {r.candidate.layout.name: r for r in layout_points(results)}
    if not best:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, r), style in zip(best.items(), line_styles(len(best))):
        pts = sorted(r.probes, key=lambda p: p.qps)
        x = [p.qps / r.candidate.layout.gpus for p in pts]
        for ax, key in zip(axes, ("tbt_p99_s", "ttft_p99_s")):
            y = [p.detail.get(key) or float("nan") for p in pts]
            ax.plot(x, y, lw=1.5, color=style["color"], label=f"{name} C{r.candidate.chunk_size}")
            for met in (True, False):  # one line of markers each, not one per probe
                at = [(xi, yi) for xi, yi, p in zip(x, y, pts) if p.ok is met]
                if at:
                    ax.plot(*zip(*at), ls="none", marker=style["marker"], color=style["color"],
                            markersize=5, markerfacecolor=style["color"] if met else "white")
    for ax, limit, what in ((axes[0], slo.tbt_s, "p99 time between tokens"),
                            (axes[1], slo.ttft_s, "p99 time to first token")):
        latency_axis(ax, limit, what, "request rate per GPU (req/s, Poisson)", fontsize=7)
    axes[0].set_title("best deployment of each tp x pp (filled: met the SLOs)", fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _save(fig, Path(path))


def dump_config(cfg: Config, replicas: int, path: Path, header: str) -> Path:
    """cfg as a YAML config `pp-runtime run`, `serve` and the Slurm scripts take: one
    replica's deployment (the layer split explicit; dp = the replicas to start, one `run`
    or `serve` each; workload.qps one replica's share, if set)."""
    data = cfg.to_dict()
    data["parallel"] = {**data["parallel"], "dp": replicas,
                        "layer_split": cfg.layers_per_stage() if cfg.parallel.pp > 1 else None}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(lines + yaml.safe_dump(data, sort_keys=False))
    return path


def winner_config(r: Result, cfg: Config, slo: Slo, path: Path) -> Path:
    """The winner's config (`dump_config`), its capacity in the header."""
    c = r.candidate
    cfg = cfg.with_overrides(**{"workload.qps": round(r.qps / c.layout.replicas, 6)})
    return dump_config(cfg, c.layout.replicas, path, (
        f"pp-runtime plan's choice: {c.name}\n"
        f"capacity {r.qps:.4f} req/s ({r.per_gpu:.5f} per GPU) with p99 TTFT <= {_ms(slo.ttft_s)} "
        f"and p99 TBT <= {_ms(slo.tbt_s)} (simulated)\n"
        f"{c.layout.replicas} replica(s) of tp {c.layout.tp} x pp {c.layout.pp}: start one "
        f"`pp-runtime serve --config {Path(path).name}` per replica; workload.qps is one "
        "replica's share of the rate"))
