"""Incremental detokenization (`serve/text.py: HFDecoder`): the pieces a stream hands out
join to the full decode of the same ids, for a byte-level BPE whose characters span
several tokens, through `tokenizers`' DecodeStream (a fast tokenizer) and through the
window (a slow one); and the work per token does not grow with the completion."""
import random

import pytest

from pp_runtime.serve.text import HFDecoder

TEXT = ("naïve café déjà vu, Grüße aus Köln; 日本語のテキスト 😀🎉 emoji and ascii text, "
        "données über alles ") * 4


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


class Slow:
    """The same tokenizer seen as a slow one (no backend_tokenizer): the window path;
    counts the ids each decode is given."""

    def __init__(self, fast):
        self.fast, self.sizes = fast, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(decoder, ids):
    return "".join(decoder.add(t) for t in ids)


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_pieces_join_to_the_full_decode(tokenizer, path):
    rng = random.Random(0)
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    cases = [tokenizer.encode(TEXT), tokenizer.encode(TEXT)[3:]]  # also from mid-character
    cases += [[rng.randrange(len(tokenizer)) for _ in range(200)] for _ in range(5)]
    cases += [tokenizer.encode("é") + [eos] + tokenizer.encode("ü x")]
    for ids in cases:
        tok = tokenizer if path == "fast" else Slow(tokenizer)
        got = stream(HFDecoder(tok), ids)
        want = tokenizer.decode(ids, skip_special_tokens=True)
        assert got == want.rstrip("\ufffd") or got == want


def test_the_window_stays_short_however_long_the_stream(tokenizer):
    slow = Slow(tokenizer)
    ids = tokenizer.encode(TEXT * 5)
    assert stream(HFDecoder(slow), ids) == tokenizer.decode(ids)
    assert len(ids) > 1000 and max(slow.sizes) <= 8  # was len(ids): every id so far
