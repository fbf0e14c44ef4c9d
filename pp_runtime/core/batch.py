"""The plain data that crosses from the planner to the executors and back. No torch.

A `MicroBatch` is a list of sequences, each a contiguous run of tokens of one request:
a prefill chunk (positions [start, start + n)) or a decode (n = 1). Executors flatten all
tokens into one [num_tokens, hidden] tensor, in this order.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable


@dataclass(frozen=True)
class Sampling:
    """How the last stage picks the next token of one sequence."""

    temperature: float  # 0 = greedy
    top_p: float
    seed: int  # per-request seed; combined with the position, so results never depend on batching


@dataclass(frozen=True)
class SeqChunk:
    request_id: int
    blocks: list[int]  # the request's KV block table: position p is in blocks[p // block_size]
    #                    (covers [0, kv_len) at least; shared with the planner, never copied)
    start: int  # position of the first token; tokens [0, start) are already in the KV cache
    token_ids: tuple[int, ...]  # input ids (used by stage 0)
    sampling: Sampling | None  # set when this chunk ends the known tokens: sample the next one
    is_decode: bool = False  # a generated token fed back (else: a chunk of the prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        """KV length after this chunk (what its last token attends to)."""
        return self.start + self.num_tokens


_new = object.__new__


def seq_chunk(request_id: int, blocks: list[int], start: int, token_ids: tuple[int, ...],
              sampling: Sampling | None, is_decode: bool = False) -> SeqChunk:
    """`SeqChunk(request_id, blocks, start, token_ids, sampling, is_decode)`, the same
    object, without the six `object.__setattr__` calls of a frozen dataclass's __init__
    (the planners make one per sequence of every micro-batch: 10^7 in a large simulation,
    half the cost of a decode's planning)."""
    chunk = _new(SeqChunk)
    d = chunk.__dict__
    d["request_id"] = request_id
    d["blocks"] = blocks
    d["start"] = start
    d["token_ids"] = token_ids
    d["sampling"] = sampling
    d["is_decode"] = is_decode
    return chunk


def slot_blocks(slot: int, blocks_per_slot: int) -> list[int]:
    """The block table of whole context number `slot` of a pool cut into equal contexts of
    `blocks_per_slot` blocks (how tests, benchmarks and the profiler address the cache)."""
    return list(range(slot * blocks_per_slot, (slot + 1) * blocks_per_slot))


def slot_tables(seqs, blocks_per_slot: int) -> tuple["SeqChunk", ...]:
    """Shorthand for hand-made micro-batches: a SeqChunk whose `blocks` is an int n gets
    the table of whole context n (`slot_blocks`); the others are kept."""
    return tuple(replace(s, blocks=slot_blocks(s.blocks, blocks_per_slot))
                 if isinstance(s.blocks, int) else s for s in seqs)


@dataclass(frozen=True)
class MicroBatch:
    mb_id: int
    seqs: tuple[SeqChunk, ...]
    # set by the driver: seconds just before this micro-batch with no arrived, unfinished
    # request anywhere (a duration, so every stage can use it on its own clock; bubbles.md)
    idle_before_s: float = 0.0
    # the token hop (docs/distributed.md): (index in `seqs`, id of the micro-batch whose
    # sample is this decode's input) for each decode planned before its input token came
    # back; such a decode's `token_ids` is (PLACEHOLDER,) until stage 0 fills it in
    placeholders: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs if not s.is_decode)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode)


def micro_batch(mb_id: int, seqs: tuple[SeqChunk, ...],
                placeholders: tuple[tuple[int, int], ...] = ()) -> MicroBatch:
    """`MicroBatch(mb_id, seqs, placeholders=placeholders)`, the same object, without the
    frozen dataclass's `object.__setattr__` calls (the planners make one per micro-batch:
    10^6 in a plan's search; tests/core/test_batch_fast.py checks them equal)."""
    mb = _new(MicroBatch)
    d = mb.__dict__
    d["mb_id"] = mb_id
    d["seqs"] = seqs
    d["idle_before_s"] = 0.0
    d["placeholders"] = placeholders
    return mb


PLACEHOLDER = -1  # a decode's input id not known when it was planned (MicroBatch.placeholders)


def sampling_ids(mb: MicroBatch) -> list[int]:
    """The request ids of the sequences that sample, in plan order: the order the last
    stage sends its sampled ids to stage 0 in (the token hop's message)."""
    return [s.request_id for s in mb.seqs if s.sampling is not None]


def fill_placeholders(mb: MicroBatch, tokens: "Callable[[int, int], int]") -> MicroBatch:
    """`mb` with every placeholder decode's input id filled in: `tokens(src_mb_id,
    request_id)` is the id micro-batch `src_mb_id` sampled for that request (the one
    place a placeholder is resolved: stage 0 of every executor)."""
    if not mb.placeholders:
        return mb
    seqs = list(mb.seqs)
    for i, src in mb.placeholders:
        s = seqs[i]
        if s.token_ids != (PLACEHOLDER,):
            raise ValueError(f"micro-batch {mb.mb_id}: sequence {i} (request {s.request_id}) "
                             f"is not a placeholder decode: {s.token_ids}")
        seqs[i] = replace(s, token_ids=(tokens(src, s.request_id),))
    return replace(mb, seqs=tuple(seqs), placeholders=())


@dataclass(frozen=True)
class SampledTokens:
    """What the last stage returns: one token id per sequence that sampled."""

    mb_id: int
    tokens: dict[int, int] = field(default_factory=dict)  # request id -> sampled token id
    timings: tuple["StageTiming", ...] = ()  # one per stage (and TP rank) that ran it


def sampled_tokens(mb_id: int, tokens: dict[int, int],
                   timings: tuple["StageTiming", ...]) -> SampledTokens:
    """`SampledTokens(mb_id, tokens, timings)`, the same object, without the frozen
    dataclass's `object.__setattr__` calls (the simulated executor makes one per
    micro-batch; tests/core/test_batch_fast.py checks them equal)."""
    out = _new(SampledTokens)
    d = out.__dict__
    d["mb_id"] = mb_id
    d["tokens"] = tokens
    d["timings"] = timings
    return out


@dataclass(slots=True)  # slots: a simulated run keeps ~10^6 of them
class StageTiming:
    """What one stage did for one micro-batch; seconds on that worker's clock."""

    mb_id: int
    stage: int
    tp_rank: int
    wait_s: float  # holding the call, waiting for the previous stage's activations (upstream)
    transfer_s: float  # moving the activations once they were ready
    compute_start_s: float
    compute_end_s: float
    send_wait_s: float = 0.0  # after computing: blocked until the next stage took the send (downstream)
    token_wait_s: float = 0.0  # stage 0 with the token hop: holding the call, waiting for its
    #                            decodes' input tokens from the last stage (part of dependency)

    @property
    def compute_s(self) -> float:
        return self.compute_end_s - self.compute_start_s


@dataclass(frozen=True)
class RankResult:
    """What one (stage, TP rank) returns for a micro-batch, on every executor and over
    every wire (Ray, the TP relay, torchrun's control channel): its timing, and the token
    ids it sampled where it sampled (TP rank 0 of the last stage), else None."""

    timing: StageTiming
    tokens: dict[int, int] | None = None  # request id -> sampled token id


def assemble(mb_id: int, results: Iterable[RankResult]) -> SampledTokens:
    """A micro-batch's `SampledTokens` from every rank's result, given in rank order (the
    one place it is built from workers' results): the sampling rank's tokens, every
    timing in that order."""
    tokens, timings = {}, []
    for r in results:
        timings.append(r.timing)
        if r.tokens is not None:
            tokens = r.tokens
    return SampledTokens(mb_id, tokens, tuple(timings))
