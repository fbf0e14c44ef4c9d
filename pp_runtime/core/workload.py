"""Request workloads: what arrives when, with how many prompt and output tokens.

- `zipf`: total lengths Zipf(theta) over [min_len, max_len] (rank r has weight 1 / r^theta,
  rank 1 = min_len), split into prompt and output by the P:D ratio (the paper's generator);
- `fixed`: every request has prompt_len + output_len;
- `trace`: a JSONL file, one {"arrival_s", "prompt_len", "output_len"} per line.
Prompts: random token ids of each request's length (`workload_prompts`).
Arrivals: all at once (`qps: null`) or Poisson at `qps` requests per second; a trace keeps
its own arrival times unless `qps` is set (then its lengths arrive at Poisson `qps`: what a
capacity search probes).
Pure Python + numpy; the same seed gives the same workload.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pp_runtime.core.errors import ConfigError


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "zipf"  # zipf | fixed | trace
    num_requests: int = 100  # zipf, fixed (a trace has its own length)
    min_len: int = 128  # zipf: shortest total length (prompt + output), tokens (paper: 1024)
    max_len: int = 1024  # zipf: longest total length; fits GPT-2's 1024 positions (paper: 4096)
    theta: float = 0.4  # zipf exponent: 0 = uniform, larger = more short requests
    pd_ratio: float = 10.0  # prompt tokens per output token (P:D)
    prompt_len: int = 512  # fixed
    output_len: int = 64  # fixed
    qps: float | None = None  # Poisson arrivals per second; None = all at time 0 (a
    #                          trace: its own times; set: its lengths at Poisson qps)
    trace: str | None = None  # trace: path of the JSONL file
    seed: int = 0

    def validate(self) -> "WorkloadConfig":
        def check(ok, name, problem):
            if not ok:
                raise ConfigError(f"workload.{name}: {problem}")
        check(self.kind in ("zipf", "fixed", "trace"), "kind", f"unknown kind {self.kind!r}; "
              "use zipf, fixed or trace")
        check(self.num_requests >= 1, "num_requests", f"must be >= 1, got {self.num_requests}")
        check(2 <= self.min_len <= self.max_len, "min_len",
              f"need 2 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        check(self.theta >= 0, "theta", f"must be >= 0, got {self.theta}")
        check(self.pd_ratio > 0, "pd_ratio", f"must be > 0, got {self.pd_ratio}")
        check(self.prompt_len >= 1 and self.output_len >= 1, "prompt_len",
              "prompt_len and output_len must be >= 1")
        check(self.qps is None or self.qps > 0, "qps", f"must be > 0 or null, got {self.qps}")
        check(self.kind != "trace" or self.trace, "trace", "kind trace needs a trace file")
        return self


def zipf_lengths(n: int, lo: int, hi: int, theta: float, rng: np.random.Generator) -> np.ndarray:
    """n totals in [lo, hi]: value lo + r - 1 with probability proportional to 1 / r^theta."""
    ranks = np.arange(1, hi - lo + 2, dtype=np.float64)
    p = ranks ** -theta
    return lo + rng.choice(len(ranks), size=n, p=p / p.sum())


def split_pd(total: int, pd_ratio: float) -> tuple[int, int]:
    """Prompt and output tokens of a request of `total` tokens with the given P:D ratio."""
    output = max(1, round(total / (pd_ratio + 1)))
    return total - output, output


def read_trace(path: str | Path) -> list[RequestSpec]:
    """A JSONL trace, checked line by line: arrival_s a finite number >= 0, lengths ints
    >= 1. Nothing is converted silently (10.7, true or "4" as a length is an error), and a
    problem names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"workload.trace: {path} is {'a directory' if path.is_dir() else 'not found'}; "
                          "expected a JSONL file, one {\"arrival_s\", \"prompt_len\", "
                          "\"output_len\"} per line")
    specs = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_no_constant)
        except ValueError as exc:
            raise ConfigError(f"{path}:{i}: not valid JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{i}: expected an object {{arrival_s, prompt_len, "
                              f"output_len}}, got {line.strip()[:60]}")
        missing = [k for k in ("arrival_s", "prompt_len", "output_len") if k not in row]
        if missing:
            raise ConfigError(f"{path}:{i}: no {', '.join(missing)}")
        a, p, d = row["arrival_s"], row["prompt_len"], row["output_len"]
        if not _is_number(a) or not 0 <= a < float("inf"):
            raise ConfigError(f"{path}:{i}: arrival_s must be a finite number of seconds >= 0, "
                              f"got {a!r}")
        for key, value in (("prompt_len", p), ("output_len", d)):
            if not _is_number(value) or value != int(value) or value < 1:
                raise ConfigError(f"{path}:{i}: {key} must be a whole number of tokens >= 1, "
                                  f"got {value!r}")
        specs.append(RequestSpec(float(a), int(p), int(d)))
    if not specs:
        raise ConfigError(f"{path}: no requests (an empty trace)")
    return sorted(specs, key=lambda s: s.arrival_s)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows; use a finite number")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # NaN != NaN


def poisson_arrivals(rng: np.random.Generator, qps: float, n: int) -> np.ndarray:
    """n arrival times of a Poisson process at qps requests per second, from time 0."""
    return np.cumsum(rng.exponential(1.0 / qps, size=n))


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The requests of a workload, in arrival order."""
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    if cfg.kind == "trace":
        specs = read_trace(cfg.trace)
        if cfg.qps is None:
            return specs
        arrivals = poisson_arrivals(rng, cfg.qps, len(specs))
        return [RequestSpec(float(a), s.prompt_len, s.output_len) for a, s in zip(arrivals, specs)]
    n = cfg.num_requests
    if cfg.kind == "zipf":
        lengths = [split_pd(int(t), cfg.pd_ratio)
                   for t in zipf_lengths(n, cfg.min_len, cfg.max_len, cfg.theta, rng)]
    else:
        lengths = [(cfg.prompt_len, cfg.output_len)] * n
    arrivals = np.zeros(n) if cfg.qps is None else poisson_arrivals(rng, cfg.qps, n)
    return [RequestSpec(float(a), p, d) for a, (p, d) in zip(arrivals, lengths)]


def workload_prompts(specs: list[RequestSpec], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts of the specs' lengths: the one rule for a workload's prompts
    (`llm.run_workload` offline, the load generator and capacity search over HTTP), so the
    same seed sends the same ids either way: random.Random(seed), randrange(vocab_size)
    per token, request after request."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(s.prompt_len)] for s in specs]


def write_trace(specs: list[RequestSpec], path: str | Path) -> None:
    with open(path, "w") as f:
        for s in specs:
            f.write(json.dumps({"arrival_s": s.arrival_s, "prompt_len": s.prompt_len,
                                "output_len": s.output_len}) + "\n")
