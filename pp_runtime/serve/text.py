"""Text <-> token ids for the server: the checkpoint's tokenizer, or ids as text.

With a tokenizer in the checkpoint directory (`transformers.AutoTokenizer`, local files
only), prompts may be text and completions come back as text. Without one, text is token
ids separated by spaces both ways: the prompt "5 17 3" is [5, 17, 3], and the completion's
text is its ids, so a client always gets something it can read back.

Chat prompts use the tokenizer's chat template when it has one. Otherwise the messages are
joined simply, one line each, `role: content`, followed by `assistant:` (the model was not
trained on that format: it is a plain, documented fallback); without a tokenizer the
messages' ids are concatenated in order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

from pp_runtime.core.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...
    def decoder(self) -> "Decoder": ...


class Decoder(Protocol):
    def add(self, token_id: int) -> str:
        """The text this token adds to the completion (may be "" until a character is whole)."""


class BadText(ValueError):
    """Text that cannot become token ids (no tokenizer, and not ids)."""


class IdCodec:
    """No tokenizer: text is space-separated token ids."""

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise BadText("this model has no tokenizer: send token ids, as a list of ints or "
                          "as text of space-separated ids (\"5 17 3\")") from None

    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return [t for _, content in messages for t in self.encode(content)]

    def decoder(self) -> "IdDecoder":
        return IdDecoder()


class IdDecoder:
    def __init__(self):
        self.first = True

    def add(self, token_id: int) -> str:
        text = str(token_id) if self.first else f" {token_id}"
        self.first = False
        return text


class HFCodec:
    """A `transformers` tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            conv = [{"role": r, "content": c} for r, c in messages]
            ids = self.tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.encode("".join(f"{r}: {c}\n" for r, c in messages) + "assistant:")

    def decoder(self) -> "HFDecoder":
        return HFDecoder(self.tok)


class HFDecoder:
    """Incremental detokenization in constant work per token, whatever the completion's
    length (re-decoding every id so far made a long stream O(n^2) on the event loop):
    `tokenizers`' `DecodeStream` for a fast tokenizer, as TGI and vLLM use it; for a slow
    one, the window vLLM and TGI decode: the text of the tokens since the last piece handed
    out, against the same without the newest, held back while it ends in an incomplete
    character (U+FFFD)."""

    def __init__(self, tok):
        self.tok, self.ids, self.read = tok, [], 0  # window; ids[:read] were handed out
        backend = getattr(tok, "backend_tokenizer", None)
        self.stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream, self.backend = DecodeStream(skip_special_tokens=True), backend

    def add(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[:self.read], skip_special_tokens=True)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        # the next window starts at the tokens of the piece handed out now (its context)
        self.ids, self.read = self.ids[self.read:], len(self.ids) - self.read
        return text[len(before):]


def load_codec(checkpoint: str | Path | None) -> Codec:
    """The checkpoint's tokenizer when its directory has one, else `IdCodec`."""
    if checkpoint is None or not any((Path(checkpoint) / f).exists() for f in TOKENIZER_FILES):
        return IdCodec()
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"--checkpoint {checkpoint} has a tokenizer, which needs the "
                          "transformers package: pip install transformers") from None
    return HFCodec(AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True))
