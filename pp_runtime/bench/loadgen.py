"""Load generator: a workload sent to a running `pp-runtime serve` over HTTP, streaming.

Each request of the workload (`workload.generate`: Poisson or all-at-once arrivals, or a
trace file) is posted at its arrival time to `POST /v1/completions` with `stream: true`
and a token-id prompt (random ids of the workload's prompt length: `workload_prompts`,
the rule `llm.run_workload` uses too, so offline `LLM.generate` can run the very same
requests), asking for exactly its output length (`max_tokens`, `ignore_eos`). The client timestamps the
response's server-sent events as they arrive:

- TTFT = first token's arrival - the request's send time;
- TBT (time between tokens) = arrival of each later token - arrival of the one before; the
  tokens of one event share its arrival time (gaps of 0 after the first), as a user sees them;
- a request meets the SLOs when its TTFT <= ttft_slo and its own p99 TBT <= tbt_slo.

`summarize` reports TTFT and TBT median/p90/p99 (the run report's helper and keys; TBT pooled over every token of every
request, as the simulator's report does), throughput (output tokens/s and requests/s over
the run's wall time) and SLO attainment. The HTTP client is aiohttp (declared in pyproject.toml;
also a dependency of ray[default]). No torch.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence


from pp_runtime.core.workload import RequestSpec, workload_prompts  # noqa: F401 (callers' import)
from pp_runtime.telemetry.report import percentiles as stats  # the one percentile helper

LATENCY_KEYS = ("median", "p90", "p99")  # the run report's keys (`report.json`'s ttft_s, tbt_s)


class ServerUnreachable(ConnectionError):
    """No server answers at the URL; the message is one line naming it."""


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds from the run's start)."""

    index: int  # position in the workload
    prompt_len: int
    max_tokens: int
    arrival_s: float  # when the workload says it arrives
    sent_s: float | None = None  # when the client posted it (arrival, unless the client lagged)
    token_times_s: list[float] = field(default_factory=list)  # arrival of every output token
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    status: int | None = None  # HTTP status
    error: str | None = None  # transport error, non-200 body or an error event
    server_timing: dict | None = None  # the response's `pp_runtime` field (queue_s, ttft_s, ...)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s and self.sent_s is not None else None

    @property
    def tbt_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


def _p99(values: Sequence[float]) -> float | None:
    return stats(values, ("p99",))["p99"]


def slo_attainment(results: Sequence[RequestResult], ttft_slo: float | None,
                   tbt_slo: float | None) -> dict[str, float | None]:
    """Fractions of all requests that met the TTFT SLO, the TBT SLO (their own p99 TBT;
    a request with one token has no gap and meets it) and both. A failed request meets
    none. None where that SLO is not given."""
    n = len(results)
    if not n:
        return {"ttft": None, "tbt": None, "both": None}

    def ttft_ok(r):
        return r.ok and (ttft_slo is None or (r.ttft_s is not None and r.ttft_s <= ttft_slo))

    def tbt_ok(r):
        return r.ok and (tbt_slo is None or not r.tbt_s or _p99(r.tbt_s) <= tbt_slo)

    return {"ttft": None if ttft_slo is None else sum(map(ttft_ok, results)) / n,
            "tbt": None if tbt_slo is None else sum(map(tbt_ok, results)) / n,
            "both": None if ttft_slo is None and tbt_slo is None else
            sum(ttft_ok(r) and tbt_ok(r) for r in results) / n}


def summarize(results: Sequence[RequestResult], wall_s: float, ttft_slo: float | None = None,
              tbt_slo: float | None = None) -> dict:
    """The run's figures: counts, TTFT / TBT percentiles, throughput, SLO attainment."""
    done = [r for r in results if r.ok]
    out_tokens = sum(len(r.token_times_s) for r in done)
    timing = [r.server_timing for r in done if r.server_timing]
    server = {k: stats([t[k] for t in timing if t.get(k) is not None], ("median",))["median"]
              for k in ("queue_s", "ttft_s", "generation_s", "bubble_s")} if timing else None
    return {
        "num_requests": len(results), "completed": len(done),
        "failed": len(results) - len(done),
        "rejected": sum(1 for r in results if r.status in (429, 503)),
        "wall_s": wall_s,
        "ttft_s": stats([r.ttft_s for r in done if r.ttft_s is not None], LATENCY_KEYS),
        "tbt_s": stats([g for r in done for g in r.tbt_s], LATENCY_KEYS),
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "slo": {"ttft_s": ttft_slo, "tbt_s": tbt_slo},
        "slo_attainment": slo_attainment(results, ttft_slo, tbt_slo),
        "server_median": server,  # medians of the server's own per-request timing
    }


def format_summary(s: dict, label: str = "") -> str:
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f} ms"  # noqa: E731
    t, b, a = s["ttft_s"], s["tbt_s"], s["slo_attainment"]
    lines = [f"{label + ': ' if label else ''}{s['completed']}/{s['num_requests']} requests completed "
             f"({s['failed']} failed, {s['rejected']} rejected) in {s['wall_s']:.1f} s: "
             f"{s['output_tok_s']:.1f} output tok/s, {s['requests_s']:.2f} req/s",
             f"  TTFT median {ms(t['median'])}, p90 {ms(t['p90'])}, p99 {ms(t['p99'])}; "
             f"TBT median {ms(b['median'])}, p90 {ms(b['p90'])}, p99 {ms(b['p99'])}"]
    slo = s["slo"]
    if a["both"] is not None:
        lines.append(f"  SLO attainment (TTFT <= {ms(slo['ttft_s'])}, p99 TBT <= {ms(slo['tbt_s'])}): "
                     + ", ".join(f"{k} {v:.0%}" for k, v in a.items() if v is not None))
    if s.get("server_median"):
        lines.append("  server's own timing, median per request: " + ", ".join(
            f"{k[:-2]} {ms(v)}" for k, v in s["server_median"].items()))
    return "\n".join(lines)


# ---- the requests ------------------------------------------------------------------------
def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}


def _base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


async def _get_json(session, url: str, headers: dict) -> tuple[int, dict | None]:
    import aiohttp

    try:
        async with session.get(url, headers=headers) as resp:
            body = await resp.read()
            try:
                return resp.status, json.loads(body)
            except ValueError:
                return resp.status, None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise ServerUnreachable(f"no pp-runtime server at {url}: {exc.__class__.__name__}: {exc}") from None


async def _server_model(session, base: str, headers: dict) -> str:
    """The served model's id (GET /v1/models), after checking the server answers."""
    status, body = await _get_json(session, f"{base}/v1/models", headers)
    if status != 200 or not body or not body.get("data"):
        raise ServerUnreachable(f"{base}/v1/models answered {status}: {body}")
    return body["data"][0]["id"]


def _consume_event(res: RequestResult, data: str, now: float) -> bool:
    """Apply one SSE `data:` payload to res; True at the end of the stream."""
    if data.strip() == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        res.error = f"bad event: {data[:200]}"
        return True
    if "error" in chunk:
        res.error = json.dumps(chunk["error"])[:300]
        return True
    if chunk.get("pp_runtime"):
        res.server_timing = chunk["pp_runtime"]
    for choice in chunk.get("choices", ()):
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else int(bool(choice.get("text")))
        res.token_ids += ids or []
        res.token_times_s += [now] * n
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    return False


async def send_one(session, url: str, headers: dict, body: dict, res: RequestResult,
                   clock: Callable[[], float]) -> RequestResult:
    """POST one streaming completion; fills res as events arrive."""
    import aiohttp

    res.sent_s = clock()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            async for piece in resp.content.iter_any():
                now, buf = clock(), buf + piece
                while b"\n\n" in buf:  # one server-sent event per blank-line-terminated block
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.decode().splitlines():
                        if line.startswith("data:") and _consume_event(res, line[5:].strip(), now):
                            return res
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        res.error = f"{exc.__class__.__name__}: {exc}"
    if res.finish_reason is None and res.error is None:
        res.error = "stream ended without a finish reason"
    return res


async def run_load(url: str, specs: Sequence[RequestSpec], prompts: Sequence[list[int]],
                   api_key: str | None = None, model: str | None = None,
                   progress: bool = True, desc: str = "load") -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (seconds from now) and stream its tokens.
    Returns the results in workload order and the run's wall time (first send to last
    token). ServerUnreachable when the server does not answer at all."""
    import aiohttp
    from tqdm import tqdm

    base, headers = _base(url), ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await _server_model(session, base, headers)
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        bar = tqdm(total=len(specs), unit="req", desc=desc, disable=not progress, leave=False)

        async def one(i: int, spec: RequestSpec) -> RequestResult:
            await asyncio.sleep(max(0.0, spec.arrival_s - clock()))
            res = RequestResult(i, spec.prompt_len, spec.output_len, spec.arrival_s)
            await send_one(session, f"{base}/v1/completions", headers,
                           completion_body(model, prompts[i], spec.output_len), res, clock)
            bar.update()
            return res

        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        bar.close()
    ends = [r.token_times_s[-1] for r in results if r.token_times_s]
    return list(results), (max(ends) if ends else clock())


def load_test(url: str, specs: Sequence[RequestSpec], prompts: Sequence[list[int]], *,
              api_key: str | None = None, ttft_slo: float | None = None,
              tbt_slo: float | None = None, progress: bool = True,
              desc: str = "load") -> tuple[dict, list[RequestResult]]:
    """run_load, then summarize: (summary, results)."""
    results, wall = asyncio.run(run_load(url, specs, prompts, api_key, progress=progress, desc=desc))
    return summarize(results, wall, ttft_slo, tbt_slo), results


def wait_healthy(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True,
                 api_key: str | None = None) -> float:
    """Poll GET /health until it answers 200; seconds waited. TimeoutError after timeout_s,
    RuntimeError as soon as alive() is false (the server process ended)."""
    async def poll() -> float:
        import aiohttp

        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                try:
                    status, _ = await _get_json(session, f"{_base(url)}/health", {})
                    if status == 200:
                        return time.monotonic() - t0
                except ServerUnreachable:
                    pass
                if not alive():
                    raise RuntimeError(f"the server process ended before {url}/health answered 200")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:g} s")
                await asyncio.sleep(0.5)

    return asyncio.run(poll())


def results_rows(results: Sequence[RequestResult]) -> list[dict]:
    """One flat row per request for requests.csv / JSON."""
    rows = []
    for r in results:
        row = {k: v for k, v in asdict(r).items() if k not in ("token_times_s", "token_ids", "server_timing")}
        tbt = r.tbt_s
        row.update(output_tokens=len(r.token_times_s), ttft_s=r.ttft_s,
                   tbt_p99_s=_p99(tbt),
                   **{f"server_{k}": v for k, v in (r.server_timing or {}).items()})
        rows.append(row)
    return rows
