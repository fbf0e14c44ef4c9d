"""The server's `/metrics`: the runtime's live metrics in Prometheus text, plus the server's.

`PrometheusSink` is a `telemetry.metrics.Sink`: the engine's `RuntimeMetrics` feeds it with
the same accounting (the `StageAccumulator` rule) and the same names as the Ray export
(`Metric`, e.g. `pp_runtime_stage_bubble_seconds_total{stage, cause}`), here without Ray's
`ray_` prefix. `ServeMetrics` adds what only the server knows: running and waiting
requests, prompt and generated tokens, requests by finish reason and refusals. Everything
lives in one registry per server, never prometheus_client's global one.
"""
from __future__ import annotations

from typing import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pp_runtime.telemetry.metrics import SPECS, Kind, Metric, Sink


class PrometheusSink:
    """Every `Metric` as a prometheus_client instrument in `registry`."""

    _TYPES = {Kind.COUNTER: Counter, Kind.GAUGE: Gauge, Kind.HISTOGRAM: Histogram}

    def __init__(self, registry: CollectorRegistry):
        self._instruments = {}
        for metric, spec in SPECS.items():
            extra = {"buckets": spec.boundaries + (float("inf"),)} if spec.boundaries else {}
            self._instruments[metric] = self._TYPES[spec.kind](
                metric.value, spec.description, spec.tag_keys, registry=registry, **extra)

    def record(self, metric: Metric, value: float, tags: Mapping[str, str]) -> None:
        """Add to a counter (never negative), set a gauge or observe a histogram."""
        series = self._instruments[metric].labels(**tags)
        kind = SPECS[metric].kind
        if kind is Kind.COUNTER:
            series.inc(max(value, 0.0))
        elif kind is Kind.GAUGE:
            series.set(value)
        else:
            series.observe(value)


class TeeSink:
    """Several sinks at once (Prometheus here, and Ray's when the stages run on Ray)."""

    def __init__(self, *sinks: Sink):
        self.sinks = sinks

    def record(self, metric: Metric, value: float, tags: Mapping[str, str]) -> None:
        for sink in self.sinks:
            sink.record(metric, value, tags)


class ServeMetrics:
    """The server's registry: the runtime's series and the server's own."""

    def __init__(self, deployment: str):
        self.registry = CollectorRegistry()
        self.sink = PrometheusSink(self.registry)
        labels = {"deployment": deployment}
        r = self.registry
        self.running = Gauge("pp_runtime_requests_running", "Requests holding a KV slot",
                             ["deployment"], registry=r).labels(**labels)
        self.waiting = Gauge("pp_runtime_requests_waiting", "Requests taken in that wait "
                             "for a KV slot", ["deployment"], registry=r).labels(**labels)
        self.prompt_tokens = Counter("pp_runtime_prompt_tokens", "Prompt tokens of finished "
                                     "requests", ["deployment"], registry=r).labels(**labels)
        self.generated_tokens = Counter("pp_runtime_generation_tokens", "Tokens generated",
                                        ["deployment"], registry=r).labels(**labels)
        self._finished = Counter("pp_runtime_requests_finished", "Requests ended, by finish "
                                 "reason (length, eos, aborted, error)",
                                 ["deployment", "finish_reason"], registry=r)
        self._refused = Counter("pp_runtime_requests_refused", "Requests refused before they "
                                "ran, by HTTP status (400 bad input, 429 queue full, 503 not "
                                "ready or unhealthy)", ["deployment", "status"], registry=r)
        self.labels = labels

    def finished(self, reason: str, prompt_tokens: int, generated: int) -> None:
        self._finished.labels(finish_reason=reason, **self.labels).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)

    def refused(self, status: int) -> None:
        self._refused.labels(status=str(status), **self.labels).inc()

    def scrape(self, running: int, waiting: int) -> bytes:
        self.running.set(running)
        self.waiting.set(waiting)
        return generate_latest(self.registry)
