"""Requests, sampling parameters and outputs. Plain Python: no torch.

A request keeps two counters (as in vLLM and Sarathi-Serve): tokens *scheduled* (put into
a micro-batch) and tokens *computed* (their micro-batch came back). The gap lets the next
micro-batch be planned while the previous one is still in the pipeline.
"""
from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pp_runtime.core.batch import Sampling


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens generated
    EOS = "eos"  # the model produced the end-of-sequence token
    ERROR = "error"  # the runtime failed while the request was unfinished
    ABORTED = "aborted"  # the caller gave up on it (client gone, abort by id, engine closed)

    def __str__(self) -> str:  # print as "length", not "FinishReason.LENGTH"
        return self.value


class InvalidRequestError(ValueError):
    """One or more requests of a call are invalid; no work was done for any of them.

    `field`: the request field the (first) problem names ("prompt", "max_tokens",
    "temperature", ...; None when it is not one field); `code`: a machine-readable kind
    where one applies ("context_length_exceeded"). The server maps them to its 400
    without reading the message."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code

    @classmethod
    def of(cls, problems: "list[Problem]") -> "InvalidRequestError":
        """One request's problems: every message, the first one's field and code."""
        return cls("; ".join(p.message for p in problems), problems[0].field, problems[0].code)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over the context


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a request: the field it is about, the message, a code where
    one applies."""

    field: str
    message: str
    code: str | None = None

    def __str__(self) -> str:
        return self.message


SEED_STRIDE = 1_000_003  # unseeded requests of a run with runtime seed s draw s * SEED_STRIDE + n


def default_seed(runtime_seed: int, n: int = 0) -> int:
    """The sampling seed of a request whose `SamplingParams.seed` is None: the n-th prompt
    of an `LLM.generate` call, the n-th request of a server, `Engine.add_request` (n = 0)
    when its caller gives none. The one rule for all of them."""
    return runtime_seed * SEED_STRIDE + n


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate (at most)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with this mass
    seed: int | None = None  # None = `default_seed(runtime.seed, n)`; same seed, same tokens
    ignore_eos: bool = False  # keep generating past the EOS token

    def problems(self) -> list[str]:
        """Everything wrong with these values, each naming the field; types are checked
        too (a str temperature, a bool max_tokens): nothing is converted silently."""
        return [p.message for p in self.field_problems()]

    def field_problems(self) -> list[Problem]:
        """`problems()`, each with its field."""
        out = []
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            out.append(Problem("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}"))
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            out.append(Problem("temperature", f"temperature must be a finite number >= 0 "
                                              f"(0 = greedy), got {self.temperature!r}"))
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            out.append(Problem("top_p", f"top_p must be a number in (0, 1], got {self.top_p!r}"))
        if self.seed is not None and not _is_int(self.seed):
            out.append(Problem("seed", f"seed must be an int or None, got {self.seed!r}"))
        if not isinstance(self.ignore_eos, bool):
            out.append(Problem("ignore_eos", f"ignore_eos must be True or False, got {self.ignore_eos!r}"))
        return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# slots: a simulated run holds 10^5 of them. eq=False: a request is compared by identity
# (it is one mutable entity), so the planner's `running.remove(req)` does not compare
# every other running request field by field.
@dataclass(slots=True, eq=False)
class Request:
    request_id: int
    prompt_token_ids: Sequence[int]  # a list, or RepeatedTokens (the simulator)
    params: SamplingParams
    seed: int  # resolved sampling seed
    arrival_s: float = 0.0
    blocks: list[int] | None = None  # KV block table while admitted (planner/blocks.py)
    num_scheduled: int = 0  # prompt + output tokens put into micro-batches
    num_computed: int = 0  # of those, tokens whose micro-batch came back
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0  # times its blocks were taken back (it then computes again)
    num_recomputed: int = 0  # computed tokens whose KV a preemption dropped (to compute again)
    num_cached: int = 0  # prefill tokens found in the prefix cache, not computed
    num_keyed: int = 0  # positions [0, num_keyed) are in keyed blocks (prefix caching)
    last_key: bytes = b""  # the prefix cache's key of the last keyed block
    # tokens to prefill: the prompt, or after a preemption the prompt and every generated
    # token (the last chunk samples the next one); the planners' "in prefill" test
    prefill_len: int = field(init=False, repr=False)
    # set once from the prompt, never changed: a plain attribute, not a property, because
    # the planners read it for every admitted request on every micro-batch
    prompt_len: int = field(init=False, repr=False)
    _sampling: Sampling = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_len = self.prefill_len = len(self.prompt_token_ids)
        self._sampling = Sampling(self.params.temperature, self.params.top_p, self.seed)

    @property
    def in_prefill(self) -> bool:
        """Prefill tokens remain to be scheduled."""
        return self.num_scheduled < self.prefill_len

    @property
    def in_flight(self) -> bool:
        """Part of a micro-batch that has not come back yet."""
        return self.num_scheduled > self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def sampling(self) -> Sampling:
        """How the last stage picks this request's next token."""
        return self._sampling

    def output(self, error: str | None = None) -> "RequestOutput":
        """What the caller gets back; `error` is kept only when the request ended in error.
        A finished request's tokens never change again, so they are shared, not copied
        (a simulation of 10^5 requests holds 10^7 of them)."""
        tokens = self.output_token_ids if self.finished else list(self.output_token_ids)
        return RequestOutput(self.request_id, self.prompt_token_ids, tokens,
                             self.finish_reason, self.arrival_s, self.first_token_s, self.finish_s,
                             error if self.finish_reason == FinishReason.ERROR else None,
                             self.num_cached, self.num_preemptions, self.num_recomputed)

    def output_cap(self, seq_len: int) -> int:
        """Tokens it may make: its `max_tokens`, within a context of `seq_len` positions."""
        return min(self.params.max_tokens, seq_len - self.prompt_len)

    def token_range(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids at positions [start, end) (prompt, then generated tokens)."""
        n = self.prompt_len
        if end <= n:
            return tuple(self.prompt_token_ids[start:end])
        return tuple(self.prompt_token_ids[start:n]) + tuple(self.output_token_ids[max(0, start - n):end - n])

    def preempted(self) -> None:
        """Its blocks were taken back: compute everything known again, from position 0."""
        self.num_preemptions += 1
        self.restart()

    def restart(self) -> None:
        """Its KV is gone (preempted, or its stage's worker was replaced): holding no
        blocks, it computes everything known again from position 0; the tokens it had
        computed count as recomputed."""
        self.blocks = None
        self.num_recomputed += self.num_computed
        self.prefill_len = self.prompt_len + len(self.output_token_ids)
        self.num_scheduled = self.num_computed = self.num_keyed = 0
        self.last_key = b""

    def resume(self, generated: Sequence[int]) -> None:
        """Continue a request that already generated `generated` (a journal, a recovery):
        they join its prefill, and the prefill's last chunk samples the next token."""
        self.output_token_ids = list(generated)
        self.prefill_len = self.prompt_len + len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        """Token id at a sequence position (prompt, then generated tokens)."""
        n = self.prompt_len
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]


class RepeatedTokens(Sequence):
    """A prompt of one token id repeated `length` times, in O(1) memory.

    The simulator's prompts are runs of token 0 whose lengths alone matter: as lists they
    would take 8 bytes per token (1.6 GB for 100K requests of the paper's workload) and
    slow down every full garbage collection, which visits each element. Slices are tuples (what a prefill
    chunk carries); it compares equal to any sequence with the same tokens.
    """

    __slots__ = ("token", "length")

    def __init__(self, token: int, length: int):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.token, self.length = token, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return (self.token,) * len(range(*index.indices(self.length)))
        if not -self.length <= index < self.length:
            raise IndexError("RepeatedTokens index out of range")
        return self.token

    def __iter__(self):
        return itertools.repeat(self.token, self.length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RepeatedTokens):
            return self.length == other.length and (self.token == other.token or not self.length)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == self.length and all(t == self.token for t in other)
        return NotImplemented

    __hash__ = None  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"RepeatedTokens(token={self.token}, length={self.length})"


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: Sequence[int]
    token_ids: list[int]  # generated ids
    finish_reason: FinishReason
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    error: str | None = None  # what failed, when finish_reason is ERROR
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    num_preemptions: int = 0  # times its KV was taken back and computed again
    num_recomputed_tokens: int = 0  # computed tokens whose KV a preemption dropped


def check_requests(prompt_token_ids: object, params: object, arrival_s: object,
                   vocab_size: int, max_len: int
                   ) -> tuple[list[list[int]], list[SamplingParams], list[float]]:
    """The prompts, one SamplingParams per prompt and one arrival time per prompt, checked
    before anything runs: InvalidRequestError names every bad request by index (and the
    fix), so a bad call runs nothing and the engine stays usable."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise InvalidRequestError(
            "prompt_token_ids must be a list of prompts, each a list of int token ids "
            f"(e.g. [[1, 2, 3]]), got {type(prompt_token_ids).__name__}")
    prompts = [list(p) if isinstance(p, (list, tuple)) else p for p in prompt_token_ids]
    n = len(prompts)
    plist = _one_per_prompt(SamplingParams() if params is None else params, n, SamplingParams,
                            "params", "a SamplingParams or a list of one per prompt", "SamplingParams")
    arrivals = [0.0] * n if arrival_s is None else _one_per_prompt(  # () : never a single value
        arrival_s, n, (), "arrival_s", "a list of seconds, one per prompt", "arrival_s times")
    problems = []
    for i, (prompt, sp, at) in enumerate(zip(prompts, plist, arrivals)):
        errs = check_prompt(prompt, sp, vocab_size, max_len)
        if not _is_real(at) or not 0 <= at < math.inf:
            errs.append(f"arrival_s must be a finite number of seconds >= 0, got {at!r}")
        elif i and _is_real(arrivals[i - 1]) and at < arrivals[i - 1]:
            errs.append(f"arrival_s {at!r} is before request {i - 1}'s {arrivals[i - 1]!r}; "
                        "arrival times must not decrease")
        if errs:
            problems.append(f"request {i}: {'; '.join(errs)}")
    if problems:
        raise InvalidRequestError(f"{len(problems)} of {n} requests rejected, none run:\n  "
                                  + "\n  ".join(problems))
    return prompts, plist, [float(a) for a in arrivals]


def _one_per_prompt(value: object, n: int, single: type | tuple, name: str, expected: str,
                    plural: str) -> list:
    """`value` for each of n prompts: one value repeated, or a sequence of exactly n."""
    if isinstance(value, single):
        return [value] * n
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise InvalidRequestError(f"got {n} prompts but {len(value)} {plural}")
        return list(value)
    raise InvalidRequestError(f"{name} must be {expected}, got {type(value).__name__}")


def check_prompt(prompt: object, params: object, vocab_size: int, max_len: int) -> list[str]:
    """Everything wrong with one request; empty when it can run."""
    return [p.message for p in prompt_problems(prompt, params, vocab_size, max_len)]


def prompt_problems(prompt: object, params: object, vocab_size: int,
                    max_len: int) -> list[Problem]:
    """`check_prompt` with each problem's field: the one set of prompt checks, for
    `generate`, the engine and the server alike. A context overflow names the prompt when
    the prompt alone fills the context, else max_tokens."""
    if not isinstance(params, SamplingParams):
        return [Problem("params", f"params must be a SamplingParams, got {params!r}")]
    out = params.field_problems()
    if not isinstance(prompt, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return out + [Problem("prompt", "prompt must be a list of int token ids")]
    if len(prompt) == 0:
        out.append(Problem("prompt", "prompt is empty (no tokens)"))
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        out.append(Problem("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"))
    if _is_int(params.max_tokens) and len(prompt) + params.max_tokens > max_len:
        out.append(Problem(
            "prompt" if len(prompt) >= max_len else "max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{len(prompt) + params.max_tokens} exceeds max positions {max_len}",
            CONTEXT_LENGTH_EXCEEDED))
    return out
