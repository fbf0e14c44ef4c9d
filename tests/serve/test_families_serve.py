"""`pp-runtime serve` on the llama family's other checkpoints, driven by the official
`openai` client: LLaMA-3 (llama3 RoPE scaling), Qwen2, Qwen3 and Mistral (window 16, which
the prompts pass) checkpoints (random weights), each with a byte-level BPE
tokenizer and a ChatML chat template built here and saved beside the weights, loaded by the
server from the checkpoint directory. Completions and chat, whole and streamed: the token
ids are transformers' greedy ones, and the text is the tokenizer's decode of them, across
characters of several bytes (the prompts and the random completions have them)."""
import pytest

from running_server import Server
from test_server import hf_argmax
from test_text import TEXT

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a server process per family (pytest.ini)

NEW = 10
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FLAGS = ["--set", "executor=local", "--set", "threads_per_worker=1", "--set", "chunk_size=16",
         "--set", "tile_size=16", "--set", "block_size=4"]


def save_tokenizer(path):
    """Byte-level BPE over accented, CJK and emoji text: 300 ids (the model's vocabulary),
    Qwen's special tokens, its ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    assert len(fast) == 300
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "mistral"])
def served(request, tmp_path_factory):
    """(transformers model, tokenizer, server, openai client)."""
    from conftest import hf_model

    path = tmp_path_factory.mktemp(f"served-{request.param}")
    model = hf_model(request.param, eos_token_id=2)  # <|im_end|>
    model.save_pretrained(path)
    tok = save_tokenizer(path)
    srv = Server("--checkpoint", str(path), *FLAGS)
    try:
        srv.wait_ready()
        yield model, tok, srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="none",
                                             max_retries=0, timeout=60)
    finally:
        srv.stop()


def model_name(server) -> str:
    return server.json("GET", "/v1/models")[1]["data"][0]["id"]


def text_of(tok, ids) -> str:
    """The tokenizer's decode; a stream holds back a trailing incomplete character."""
    return tok.decode(ids, skip_special_tokens=True)


def test_completions_stream_transformers_tokens_and_text(served):
    model, tok, server, client = served
    prompt = "naïve café, Grüße aus Köln; 日本語 😀"
    ids = tok.encode(prompt)
    want = hf_argmax(model, ids, NEW)
    kw = dict(model=model_name(server), prompt=prompt, max_tokens=NEW, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    assert whole.token_ids == want
    assert whole.text == text_of(tok, want) or whole.text == text_of(tok, want).rstrip("\ufffd")
    chunks = list(client.completions.create(stream=True, **kw))
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text


def test_chat_uses_the_checkpoints_template(served):
    model, tok, server, client = served
    messages = [{"role": "system", "content": "Réponds en français."},
                {"role": "user", "content": "données über alles 🎉"}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    assert ids[:1] == tok.convert_tokens_to_ids(["<|im_start|>"])  # the template ran
    want = hf_argmax(model, ids, NEW)
    kw = dict(model=model_name(server), messages=messages, max_tokens=NEW, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].token_ids == want
    content = whole.choices[0].message.content
    assert content == text_of(tok, want) or content == text_of(tok, want).rstrip("\ufffd")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == content
