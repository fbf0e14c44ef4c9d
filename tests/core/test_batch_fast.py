"""The hot path's constructors of the batch dataclasses make the same objects as the
dataclasses do (every field, defaults included)."""
from dataclasses import fields

from pp_runtime.core.batch import (MicroBatch, SampledTokens, SeqChunk, StageTiming, micro_batch,
                                   sampled_tokens, seq_chunk)


def _same(fast, slow) -> None:
    assert type(fast) is type(slow)
    assert fast == slow
    assert vars(fast) == vars(slow)  # every field set, none more
    assert [f.name for f in fields(slow)] == list(vars(fast))


def test_micro_batch_is_the_dataclass():
    seqs = (seq_chunk(1, [0], 0, (5, 6), None), seq_chunk(2, [1], 3, (7,), None, True))
    _same(micro_batch(4, seqs), MicroBatch(4, seqs))
    _same(micro_batch(4, seqs, ((1, 2),)), MicroBatch(4, seqs, placeholders=((1, 2),)))


def test_sampled_tokens_is_the_dataclass():
    timings = (StageTiming(4, 0, 0, 0.0, 0.0, 1.0, 2.0),)
    _same(sampled_tokens(4, {1: 0}, timings), SampledTokens(4, {1: 0}, timings))


def test_seq_chunk_is_the_dataclass():
    _same(seq_chunk(1, [0], 3, (7,), None, True), SeqChunk(1, [0], 3, (7,), None, True))
