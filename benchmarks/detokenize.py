"""Streaming detokenization on the server's event loop: the decoder `serve/text.py` uses
now (`tokenizers`' DecodeStream for a fast tokenizer) against re-decoding every id so far
for every token (what it did before, O(n^2) per request). A byte-level BPE trained here on
multilingual text (no download), one stream of --tokens tokens.

    python benchmarks/detokenize.py [--tokens 4000]
"""
from __future__ import annotations

import argparse
import time

from pp_runtime.serve.text import HFDecoder

TEXT = ("naïve café déjà vu, Grüße aus Köln; 日本語のテキスト 😀🎉 emoji and ascii text, "
        "données über alles ") * 4


class ReDecodeAll:
    """The decoder before: decode all ids so far, hand out the new suffix."""

    def __init__(self, tok):
        self.tok, self.ids, self.sent = tok, [], 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    n = ap.parse_args().tokens
    tok = tokenizer()
    ids = tok.encode(TEXT * (n // 50 + 1))[:n]
    times = {}
    for name, dec in (("re-decode all (before)", ReDecodeAll(tok)), ("DecodeStream (now)", HFDecoder(tok))):
        t0 = time.perf_counter()
        text = "".join(dec.add(i) for i in ids)
        times[name] = time.perf_counter() - t0
        assert text == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        print(f"{name:24} {len(ids)} tokens in {times[name] * 1e3:8.1f} ms "
              f"({times[name] / len(ids) * 1e6:7.1f} us per token)")
    before, now = times.values()
    print(f"before / now: {before / now:.0f}x")


if __name__ == "__main__":
    main()
