"""Faults under load: `pp-runtime serve` keeps every stream whole while its stage actors die.

Starts `pp-runtime serve --config cpu/gpt2_pp2` on 127.0.0.1 (ready at /health 200) and
keeps --streams streaming completions open with the official `openai` client (greedy,
token-id prompts: no tokenizer, the text is the ids; a stream starts the sequence's next
request as one ends), in two phases of --minutes on the same server:
  1. fault-free: the reference (every prompt of the sequence at least once);
  2. faults: the same sequence again while one stage actor process gets SIGKILL (--hang:
     SIGSTOP, a real hang, the server with runtime.step_timeout_s=5) every --kill-every
     s, stages in turn (found by its title `ray::stage<S>-tp0.execute`); after each fault,
     once /health is 200 again, the memory of the server and every process under it.
Checks (exit 1 when one fails): every request ends with finish_reason length and all its
tokens; each chunk's text has as many ids as its token_ids and the chunks' text is the ids'
(no duplicate, no gap: a mismatch is diagnosed against the fault-free tokens); each
faulty-run completion equals the fault-free one of its prompt; service back within
--back-slo of each fault (the end of the longest silence of all streams, and /health 200);
p99 time between tokens (TBT) outside the outages (gaps overlapping [fault, back]) within
--tbt-tolerance of the fault-free p99; memory after the last recovery within
--mem-tolerance of the first; pp stage actors after each; pp_runtime_recoveries_total at
/metrics = the faults. One table on stdout, faults-kill.json (-hang) in --out.

    python benchmarks/faults.py                  # 32 streams, 5 + 5 min, SIGKILL every 30 s
    python benchmarks/faults.py --quick          # 8 streams, 1 + 1 min, every 15 s
    python benchmarks/faults.py --hang --quick   # SIGSTOP instead of SIGKILL
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import random
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1


sys.path.insert(0, str(Path(__file__).resolve().parent))  # faults_procs beside this file
from faults_procs import Fault, Health, Killer, alive, memory, phase_share  # noqa: E402


# ---- the request sequence and what a stream saw ------------------------------------------

def plan(k: int, n_prompts: int, vocab: int, tokens: tuple[int, int]):
    """Request k of the sequence: (prompt index, prompt ids (16-128), max_tokens). Prompts
    repeat every n_prompts requests (the prefix cache is hit, as in real traffic)."""
    p = k % n_prompts
    rng = random.Random(1_000_003 + p)
    return p, [rng.randrange(vocab) for _ in range(16 + rng.randrange(113))], rng.randint(*tokens)


@dataclass
class Req:
    k: int
    prompt: int
    max_tokens: int
    chunks: list = field(default_factory=list)  # (arrival, token ids, text) per chunk
    finish: str | None = None
    usage: int | None = None  # completion_tokens of the last chunk
    error: str | None = None

    @property
    def ids(self) -> list[int]:
        return [t for _, ids, _ in self.chunks for t in ids]

    @property
    def token_times(self) -> list[float]:
        return [t for t, ids, _ in self.chunks for _ in ids]


def diagnose(ids: list[int], ref: list[int]) -> str | None:
    """None when equal; else where they part and how: a duplicate (tokens sent again), a
    gap (tokens skipped) or other tokens."""
    if ids == ref:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    rest = ids[i:i + 8]
    for n in range(1, i + 1):  # ids go on as ref did n tokens back: n sent twice
        if rest and rest == ref[i - n:i - n + len(rest)]:
            return f"duplicate of {n} token(s) at index {i}"
    for n in range(1, len(ref) - i + 1):  # ids go on as ref does n tokens on: n lost
        if rest and rest == ref[i + n:i + n + len(rest)]:
            return f"gap of {n} token(s) at index {i}"
    return f"differs from index {i} ({len(ids)} vs {len(ref)} tokens)"


def stream_problems(r: Req, ref: list[int] | None) -> list[str]:
    """What is wrong with one request's stream (empty: nothing)."""
    if r.error:
        return [f"error: {r.error}"]
    out, ids = [], r.ids
    if r.finish != "length":
        out.append(f"finish_reason {r.finish!r}")
    if len(ids) != r.max_tokens or r.usage not in (None, r.max_tokens):
        out.append(f"{len(ids)} tokens streamed, usage {r.usage}, max_tokens {r.max_tokens}")
    if any(len(text.split()) != len(c) for _, c, text in r.chunks):
        out.append("a chunk's text and token_ids disagree")
    if "".join(text for _, _, text in r.chunks) != " ".join(map(str, ids)):
        out.append("the chunks' text is not the streamed ids")
    if ref is not None and (why := diagnose(ids, ref)):
        out.append(f"not the fault-free tokens: {why}")
    return out


def service_back(t_fault: float, arrivals: list[float], until: float):
    """(start, end) of the longest silence of all streams together from the last token
    before t_fault through `until` (arrivals sorted): the outage; end None if no token came."""
    i = bisect.bisect_right(arrivals, t_fault)
    seq = [arrivals[i - 1] if i else t_fault] + arrivals[i:bisect.bisect_right(arrivals, until)]
    if len(seq) < 2:
        return seq[0], None
    return max(zip(seq, seq[1:]), key=lambda ab: ab[1] - ab[0])


def gaps_outside(reqs: list[Req], windows: list[tuple[float, float]]) -> tuple[list[float], int]:
    """Every gap between two tokens of a request but those overlapping a window; and how
    many were left out."""
    kept, dropped = [], 0
    for r in reqs:
        t = r.token_times
        for a, b in zip(t, t[1:]):
            if any(a < w1 and b > w0 for w0, w1 in windows):
                dropped += 1
            else:
                kept.append(b - a)
    return kept, dropped


def p(values: list[float], key: str) -> float | None:
    from pp_runtime.telemetry.report import percentiles  # the project's one percentile rule

    return percentiles(values, (key,))[key]


# ---- load -----------------------------------------------------------------------------

async def _stream(client, model: str, prompt: list[int], r: Req) -> None:
    try:
        s = await client.completions.create(model=model, prompt=prompt, max_tokens=r.max_tokens,
                                            temperature=0, seed=r.prompt, stream=True,
                                            extra_body={"ignore_eos": True})
        async for ch in s:
            now, c = time.monotonic(), ch.choices[0]
            r.chunks.append((now, list(getattr(c, "token_ids", None) or []), c.text or ""))
            r.finish = c.finish_reason or r.finish
            if ch.usage is not None:
                r.usage = ch.usage.completion_tokens
    except Exception as exc:  # an HTTP error, an error event, a timeout
        r.error = f"{type(exc).__name__}: {exc}"[:300]


def run_load(url: str, args, seconds: float, min_requests: int = 0) -> list[Req]:
    """args.streams streams, each starting the sequence's next request when one ends, for
    `seconds` (and until min_requests started); the open ones then finish (args.drain_s at
    most: a request still open then is a hang)."""
    from openai import AsyncOpenAI

    reqs: list[Req] = []

    async def main():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                             timeout=args.request_timeout_s)
        model = (await client.models.list()).data[0].id
        ks, t_end = itertools.count(), time.monotonic() + seconds

        async def stream():
            while (k := next(ks)) < min_requests or time.monotonic() < t_end:
                pi, prompt, n = plan(k, args.prompts, args.vocab, args.tokens)
                reqs.append(r := Req(k, pi, n))
                await _stream(client, model, prompt, r)
                if r.error:
                    await asyncio.sleep(1.0)  # no busy loop against a failed server

        tasks = [asyncio.create_task(stream()) for _ in range(args.streams)]
        _, left = await asyncio.wait(tasks, timeout=seconds + args.drain_s)
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await client.close()

    asyncio.run(main())
    for r in reqs:
        if r.finish is None and r.error is None:
            r.error = f"still open {args.drain_s:.0f} s after the phase ended (a hang)"
    return reqs


# ---- figures and checks -----------------------------------------------------------------

def reference(reqs: list[Req]) -> tuple[dict[int, list[int]], int]:
    """Prompt index -> its fault-free tokens (requests without a problem), and how many
    prompts the fault-free run itself answered in more than one way."""
    seen: dict[int, set] = {}
    for r in reqs:
        if not stream_problems(r, None):
            seen.setdefault(r.prompt, set()).add(tuple(r.ids))
    return {k: list(min(v)) for k, v in seen.items()}, sum(len(v) > 1 for v in seen.values())


def per_request(reqs: list[Req], ref: dict[int, list[int]] | None) -> tuple[int, list[str]]:
    """(requests without a problem, one line per problem)."""
    ok, lines = 0, []
    for r in reqs:
        probs = stream_problems(r, None if ref is None else ref.get(r.prompt))
        if ref is not None and r.prompt not in ref:
            probs.append("no fault-free completion of this prompt to compare with")
        ok += not probs
        lines += [f"request {r.k} (prompt {r.prompt}, {r.max_tokens} tokens): {x}" for x in probs]
    return ok, lines


def outages(faults: list[Fault], reqs: list[Req], end: float) -> list[dict]:
    """Per fault: when the silence began, when tokens and /health came back (s after the
    fault), the later of both, when every stream it cut had its next token, and the outage
    window: [fault or silence, the last of these]."""
    times = [r.token_times for r in reqs]
    arrivals, rows = sorted(t for ts in times for t in ts), []
    for i, f in enumerate(faults):
        until = faults[i + 1].t if i + 1 < len(faults) else end
        start, back = service_back(f.t, arrivals, until)
        ends = [x for x in (back, f.health_back) if x is not None]
        resumed = [ts[j] for ts in times if 0 < (j := bisect.bisect_right(ts, start)) < len(ts)
                   and ts[j] <= until]  # the streams the fault cut, each one's next token
        rows.append({**asdict(f), "silence_from_s": start - f.t,
                     "tokens_back_s": None if back is None else back - f.t,
                     "health_back_s": None if f.health_back is None else f.health_back - f.t,
                     "back_s": max(ends) - f.t if len(ends) == 2 else None,
                     "all_back_s": max(resumed) - f.t if resumed else None,
                     "window": (min(start, f.t), max(ends + resumed, default=end))})
    return rows


def scrape(url: str) -> dict[str, float]:
    """The recovery series and finished requests at /metrics: 'name{labels}' -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    raw = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()) if k != 'deployment')}}}":
            s.value for fam in text_string_to_metric_families(raw) for s in fam.samples
            if re.match(r"pp_runtime_(recover|recomputed|requests_finished_total)", s.name)
            and not s.name.endswith("_created")}


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def table(ref_reqs, reqs, rows, f: dict, args) -> list[str]:
    col = lambda name, a, b: f"{name:38}{a:>13}{b:>13}"  # noqa: E731
    out = [f"faults under load: {args.config}, {args.streams} streams, {args.minutes:g} min per phase, "
           f"{'SIGSTOP (a hang)' if args.hang else 'SIGKILL'} of a stage actor every {args.kill_every:g} s",
           col("", "fault-free", "faults"),
           col("requests without a problem", f"{f['ref_ok']}/{len(ref_reqs)}", f"{f['ok']}/{len(reqs)}"),
           col("tokens streamed", sum(len(r.ids) for r in ref_reqs), sum(len(r.ids) for r in reqs)),
           col("prompts / answered two ways", f"{f['prompts']} / {f['twice']}", ""),
           col("CPU of other processes (of all cores)", *(f"{x:.0%}" for x in args.others)),
           col("p50 TBT (faults: outside outages)", ms(f["p50_ref"]), ms(f["p50"])),
           col("p99 TBT (faults: outside outages)", ms(f["p99_ref"]), ms(f["p99"]))
           + (f"  {f['p99'] / f['p99_ref']:.2f}x; {f['dropped']} gaps in outages left out"
              if f["p99"] and f["p99_ref"] else ""),
           col(f"p99 TBT, also {args.settle_s:g} s after outages out", "", ms(f["p99_settled"])),
           f"{'#':>3}{'at':>7}{'stage':>6}{'pid':>8}{'silence from':>13}{'tokens back':>12}{'all back':>10}"
           f"{'/health 200':>12}{'RSS MiB':>9}{'actors':>7}{'load':>6}{'others':>7}  /health meanwhile"]
    for r in rows:
        out.append(f"{r['n']:>3}{r['at_s']:>6.0f}s{r['stage']:>6}{str(r['pid']):>8}"
                   f"{sec(r['silence_from_s']):>13}{sec(r['tokens_back_s']):>12}{sec(r['all_back_s']):>10}"
                   f"{sec(r['health_back_s']):>12}{r['rss_mib'] or 0:>9.0f}{str(r['actors']):>7}{r['load'] or 0:>6.1f}{r['others'] or 0:>7.0%}  "
                   f"{','.join(r['statuses']) or 'never 503'}"
                   + ("" if r["hung_pid_alive"] is None else f"; stopped pid alive after: {r['hung_pid_alive']}"))
    slow = max(rows, key=lambda r: r["back_s"] or 1e9, default=None)
    if slow and slow["timeline"]:
        out.append(f"fault {slow['n']}, the slowest: Ray process titles as they changed (s after the fault):")
        out += [f"  {t:6.2f} s  {q}  {name}" for t, q, name in slow["timeline"][:24]]
    known = [r["back_s"] for r in rows if r["back_s"] is not None]
    out.append(f"service back (the later of tokens and /health): max {sec(max(known, default=None))}, "
               f"mean {sec(sum(known) / len(known) if known else None)}")
    if f["mems"]:
        m = f["mems"]
        out.append(f"memory (RSS, server + every process under it): {f['mem0']:.0f} MiB before the "
                   f"faults, {m[0]:.0f} after the first recovery, {m[-1]:.0f} after the last "
                   f"({m[-1] / m[0] - 1:+.1%})")
    return out + ["/metrics: " + "; ".join(f"{k} {v:g}" for k, v in sorted(f["metrics"].items()))]


def analyse(ref_reqs, reqs, rows, metrics, mem0, args) -> tuple[list[str], list[tuple[str, bool]]]:
    """The table's lines and the checks (name, passed)."""
    ref, twice = reference(ref_reqs)
    (ref_ok, ref_lines), (ok, lines) = per_request(ref_reqs, None), per_request(reqs, ref)
    windows = [r["window"] for r in rows]
    g_ref, (g, dropped) = gaps_outside(ref_reqs, [])[0], gaps_outside(reqs, windows)
    f = {"ref_ok": ref_ok, "ok": ok, "prompts": len(ref), "twice": twice, "dropped": dropped,
         "p50_ref": p(g_ref, "median"), "p50": p(g, "median"), "p99_ref": p(g_ref, "p99"),
         "p99": p(g, "p99"), "mem0": mem0, "metrics": metrics,
         "p99_settled": p(gaps_outside(reqs, [(a, b + args.settle_s) for a, b in windows])[0], "p99"),
         "mems": [r["rss_mib"] for r in rows if r["rss_mib"] is not None]}
    backs, mems = [r["back_s"] for r in rows], f["mems"]
    by_stage = {m.group(1): v for k, v in metrics.items()
                if (m := re.match(r"pp_runtime_recoveries_total\{stage=(\w+)\}", k)) and v}
    faulted = {str(s): sum(r["stage"] == s for r in rows) for s in {r["stage"] for r in rows}}
    checks = [
        ("every fault-free request complete, one answer per prompt", ref_ok == len(ref_reqs) and not twice),
        ("every faulty request complete, no duplicate or gap, = fault-free", ok == len(reqs)),
        (f"every fault injected, service back within {args.back_slo:g} s", bool(rows)
         and all(r["pid"] for r in rows) and all(b is not None and b <= args.back_slo for b in backs)),
        (f"p99 TBT outside outages within {1 + args.tbt_tolerance:.2f}x of fault-free",
         None not in (f["p99"], f["p99_ref"]) and f["p99"] <= f["p99_ref"] * (1 + args.tbt_tolerance)),
        (f"memory after the last recovery within {args.mem_tolerance:.0%} of the first",
         bool(mems) and len(mems) == len(rows) and mems[-1] <= mems[0] * (1 + args.mem_tolerance)),
        (f"{args.pp} stage actor processes after every recovery, none left stopped",
         all(r["actors"] == args.pp for r in rows) and not any(r["hung_pid_alive"] for r in rows)),
        ("pp_runtime_recoveries_total by stage = faults by stage", by_stage == faulted),
    ]
    out, problems = table(ref_reqs, reqs, rows, f, args), ref_lines + lines
    if problems:
        out += [f"{len(problems)} problem(s), the first 20:"] + ["  " + x for x in problems[:20]]
    return out + [f"{'PASS' if good else 'FAIL'}  {name}" for name, good in checks], checks


def recovery_lines(log: Path) -> list[str]:
    """The server's own account of each recovery: its log's lines that name one."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [x for x in text.splitlines() if re.search(r"recover", x, re.I) and "HTTP/1.1" not in x]


# ---- main -------------------------------------------------------------------------------

def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM too: the `with ServerProcess` block stops the server


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="config override for the server (repeatable)")
    ap.add_argument("--streams", type=int, help="streams always open (default 32; --quick 8)")
    ap.add_argument("--minutes", type=float, help="each phase's length (default 5; --quick 1)")
    ap.add_argument("--kill-every", type=float, help="seconds between faults (default 30; --quick 15)")
    ap.add_argument("--hang", action="store_true", help="SIGSTOP the stage (a hang), not SIGKILL")
    ap.add_argument("--step-timeout", type=float, default=5.0, help="--hang: runtime.step_timeout_s")
    ap.add_argument("--prompts", type=int, help="distinct prompts in the sequence (default 2 x streams)")
    ap.add_argument("--tokens", default="40,100", help="max_tokens drawn from LO,HI (4-10 s a request)")
    ap.add_argument("--back-slo", type=float, default=20.0, help="service back within this, s")
    ap.add_argument("--tbt-tolerance", type=float, default=0.2, help="p99 TBT may grow by this share")
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="a second p99 TBT also leaves out this many s after each outage")
    ap.add_argument("--mem-tolerance", type=float, default=0.1, help="memory may grow by this share")
    ap.add_argument("--recovery-wait-s", type=float, default=120.0, help="for /health 200 after a fault")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--drain-s", type=float, default=180.0, help="for the open streams after a phase")
    ap.add_argument("--quick", action="store_true", help="8 streams, 1 min phases, a fault every 15 s")
    ap.add_argument("--out", default="runs/bench-faults")
    args = ap.parse_args()
    q = args.quick
    args.streams = args.streams or (8 if q else 32)
    args.minutes = args.minutes or (1.0 if q else 5.0)
    args.kill_every = args.kill_every or (15.0 if q else 30.0)
    args.prompts = args.prompts or 2 * args.streams
    args.tokens = tuple(int(x) for x in args.tokens.split(","))
    return args


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    args = parse_args()
    from pp_runtime.bench.capacity import ServerProcess
    from pp_runtime.cli.common import parse_overrides
    from pp_runtime.config import load_config
    from pp_runtime.core.net import free_port

    sets = args.set + ([f"runtime.step_timeout_s={args.step_timeout:g}"] if args.hang else [])
    cfg = load_config(args.config, **parse_overrides(sets))
    args.vocab, args.pp = cfg.model.vocab_size, cfg.parallel.pp
    out, kind, t_start = Path(args.out), "hang" if args.hang else "kill", time.monotonic()
    log = out / f"server-{kind}.log"
    with ServerProcess(["--config", args.config, *sum((["--set", s] for s in sets), [])],
                       free_port(), log) as srv:
        print(f"server ready in {srv.ready_s:.1f} s at {srv.url}; fault-free phase: "
              f"{args.streams} streams, {args.minutes:g} min", flush=True)
        share = phase_share(srv.proc.pid)
        ref_reqs = run_load(srv.url, args, args.minutes * 60, min_requests=args.prompts)
        args.others, mem0 = [share()], memory(srv.proc.pid)[0]
        share = phase_share(srv.proc.pid)
        print(f"fault-free: {len(ref_reqs)} requests; faults phase", flush=True)
        health = Health(srv.url)
        killer = Killer(srv.proc.pid, args, health)
        health.start(), killer.start()
        try:
            reqs = run_load(srv.url, args, args.minutes * 60)
            killer.join(timeout=args.recovery_wait_s + 10)
            args.others.append(share())
        finally:
            killer.stop.set(), health.stop.set()
            for f in killer.faults:  # a stopped actor the server left behind: not kept
                if args.hang and f.pid and alive(f.pid):
                    os.kill(f.pid, signal.SIGKILL)
        end, metrics = time.monotonic(), scrape(srv.url)
    rows = outages(killer.faults, reqs, end)
    lines, checks = analyse(ref_reqs, reqs, rows, metrics, mem0, args)
    said = recovery_lines(log)
    lines += [f"the server's log: {len(said)} line(s) on recoveries, the last 12:"] + ["  " + x[:240] for x in said[-12:]]
    print("\n" + "\n".join(lines))
    path = out / f"faults-{kind}.json"
    path.write_text(json.dumps({"args": vars(args), "sets": sets, "faults": rows, "metrics": metrics,
                                "table": lines}, indent=1, default=str))
    print(f"wrote {path}; {time.monotonic() - t_start:.0f} s in all")
    return 0 if all(good for _, good in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
