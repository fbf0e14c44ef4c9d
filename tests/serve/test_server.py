"""`pp-runtime serve` as a real process on 127.0.0.1, driven by the official `openai` client
and by raw HTTP: the same greedy tokens as offline `generate` and as `transformers` (whole
and streamed, completions and chat, token ids and text through the checkpoint's
tokenizer); timing in every response; the API key; a 400 naming the field for each kind of
bad input; a client that leaves mid-stream frees the only KV slot; a full waiting queue
answers 429 while /health stays 200; /metrics parses.

One server for the module: a GPT-2 checkpoint (random weights, 1024 positions, a word-level
tokenizer "w0".."w298") in this process's executor with ONE KV slot and room for one
waiting request, so slot and queue effects are exact."""
import json
import threading
import time

import pytest

from conftest import hf_model
from running_server import Server, finished_count, next_event
from test_hf_reference import make_prompts

openai = pytest.importorskip("openai")

KEY = "test-key"
NEW = 8
FLAGS = ["--set", "max_batch_size=1", "--set", "chunk_size=16", "--set", "tile_size=16",
         "--set", "executor=local", "--set", "threads_per_worker=1", "--max-waiting", "1",
         "--set", "max_running=1"]  # one request runs at a time, whatever the KV blocks hold


def hf_argmax(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy choice token by token, EOS included (the server runs with
    ignore_eos, so it must not be suppressed as `generate(min_new_tokens=...)` would)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def words(ids: list[int]) -> str:
    """The tokenizer's text: EOS ("w0") is a special token, left out of the text (as vLLM's
    skip_special_tokens) but kept in `token_ids`."""
    return " ".join(f"w{t}" for t in ids if t != 0)


def save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(299)} | {"[UNK]": 299}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="w0").save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = hf_model("gpt", n_positions=1024)
    path = tmp_path_factory.mktemp("served-gpt")
    model.save_pretrained(path)
    save_tokenizer(path)
    return model, path


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = Server("--checkpoint", str(checkpoint[1]), *FLAGS, api_key=KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(checkpoint):
    from pp_runtime import LLM, SamplingParams

    llm = LLM.from_pretrained(checkpoint[1], max_batch_size=1, chunk_size=16, tile_size=16)
    yield lambda prompts: [o.token_ids for o in llm.generate(
        prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    llm.shutdown()


def model_name(server) -> str:
    return server.json("GET", "/v1/models")[1]["data"][0]["id"]


def test_health_needs_no_key_and_everything_else_does(server):
    assert server.json("GET", "/health", auth=False) == (200, {
        "status": "ok", "model": model_name(server), "running": 0, "waiting": 0, "recoveries": 0})
    for path in ("/v1/models", "/metrics"):
        status, body = server.json("GET", path, auth=False)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = server.json("POST", "/v1/completions", {"model": "x", "prompt": [1]}, auth=False)
    assert status == 401
    models = server.json("GET", "/v1/models")[1]["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(model_name(server), 1024)]


def test_completions_give_the_tokens_of_generate_and_transformers(server, client, checkpoint, offline):
    model, _ = checkpoint
    prompts = make_prompts(300)[:2]  # 23 and 9 tokens: the first in two chunks
    expected = offline(prompts)
    assert expected == [hf_argmax(model, p, NEW) for p in prompts]
    name = model_name(server)
    for prompt, want in zip(prompts, expected):
        kw = dict(model=name, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(prompt=prompt, **kw)
        c = whole.choices[0]
        assert c.token_ids == want and c.finish_reason == "length"
        assert c.text == words(want)  # through the tokenizer
        assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == NEW
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
        assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
        assert "".join(ch.choices[0].text for ch in chunks) == c.text
        assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
        # the same prompt as text gives the same tokens
        text = client.completions.create(prompt=" ".join(f"w{t}" for t in prompt), **kw)
        assert text.choices[0].token_ids == want


def test_chat_streams_the_tokens_of_generate(server, client, checkpoint, offline):
    """No chat template: the messages joined as "role: content" lines, then "assistant:"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint[1], local_files_only=True)
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w5 w17 w3"}]
    ids = tok.encode("system: w7 w8\nuser: w5 w17 w3\nassistant:", add_special_tokens=False)
    want = offline([ids])[0]
    kw = dict(model=model_name(server), messages=messages, max_tokens=NEW, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].token_ids == want
    assert whole.choices[0].message.content == words(want)
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_every_response_carries_the_requests_timing(server, client):
    kw = dict(model=model_name(server), prompt=[5, 6, 7], max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    for timing in (client.completions.create(**kw).pp_runtime,
                   list(client.completions.create(stream=True, **kw))[-1].pp_runtime):
        assert set(timing) == {"queue_s", "ttft_s", "generation_s", "bubble_s"}
        assert 0 <= timing["queue_s"] <= timing["ttft_s"] and timing["generation_s"] > 0
        assert timing["bubble_s"] >= 0


BAD = [  # (path, body, the field the error names)
    ("/v1/completions", b'{"model": "m", "prompt": [1, 2', "body"),
    ("/v1/completions", b'[1, 2]', "body"),
    ("/v1/completions", {"model": "gpt-4", "prompt": [1]}, "model"),
    ("/v1/completions", {"prompt": [1]}, "model"),
    ("/v1/completions", {"model": None, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": None, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": None, "prompt": [1, 300]}, "prompt"),
    ("/v1/completions", {"model": None, "prompt": [1, "2"]}, "prompt[1]"),
    ("/v1/completions", {"model": None, "prompt": [1] * 1000, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"model": None, "prompt": [1] * 1030}, "prompt"),
    ("/v1/completions", {"model": None, "prompt": [1], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": None, "prompt": [1], "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": None, "prompt": [1], "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": None, "prompt": [1], "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": None, "prompt": [1], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": None, "prompt": [1], "seed": 1.5}, "seed"),
    ("/v1/completions", {"model": None, "prompt": [1], "n": 2}, "n"),
    ("/v1/completions", {"model": None, "prompt": [1], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": None, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": None, "messages": [{"content": "w1"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": None, "messages": [{"role": "user", "content": "w1"}],
                              "max_tokens": 1022}, "max_tokens"),  # 3 prompt tokens
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[
    "malformed-json", "not-an-object", "unknown-model", "no-model", "empty-prompt",
    "empty-text", "token-outside-vocab", "str-token", "over-context", "prompt-over-context",
    "max-tokens-0", "max-tokens-str", "negative-temperature", "top-p-0", "top-p-1.5",
    "float-seed", "n-2", "stream-str", "no-messages", "message-without-role", "chat-over-context"])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, request):
    if isinstance(body, dict) and "model" in body and body["model"] is None:
        body = {**body, "model": model_name(server)}
    status, headers, raw = server.request("POST", path, body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
    assert err["message"].startswith(param.split("[")[0]) or param == "body", err
    over = request.node.callspec.id.endswith("over-context")  # the engine's check, its code
    assert (err["code"] == "context_length_exceeded") == over, err


def test_a_client_leaving_mid_stream_frees_the_only_slot(server):
    """1000 tokens would take seconds; the client reads two and hangs up: the request is
    aborted and the next one runs on the slot it held."""
    aborted = finished_count(server, "aborted")
    body = {"model": model_name(server), "prompt": [3] * 10, "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True}
    conn, resp = server.open_stream("/v1/completions", body)
    assert next_event(resp)["choices"][0]["token_ids"]
    assert next_event(resp)["choices"][0]["token_ids"]
    resp.close()  # the client is gone
    conn.close()
    status, out = server.json("POST", "/v1/completions", {**body, "max_tokens": 3}, timeout=30)
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 3
    deadline = time.monotonic() + 10
    while finished_count(server, "aborted") < aborted + 1:
        assert time.monotonic() < deadline, "the stream's request was not aborted"
        time.sleep(0.1)
    assert server.json("GET", "/health", auth=False)[1]["running"] == 0


def test_beyond_max_waiting_is_a_429_and_the_server_stays_healthy(server):
    """The slot is held by a long stream, one request waits (--max-waiting 1): the next is
    refused with Retry-After; /health stays 200; both accepted requests still finish."""
    name = model_name(server)
    long = {"model": name, "prompt": [4] * 10, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    conn, resp = server.open_stream("/v1/completions", long)
    assert next_event(resp)["choices"][0]["token_ids"]  # it holds the slot
    waiting = {}
    t = threading.Thread(target=lambda: waiting.update(r=server.json(
        "POST", "/v1/completions", {**long, "max_tokens": 2}, timeout=60)))
    t.start()
    deadline = time.monotonic() + 10
    while server.json("GET", "/health", auth=False)[1]["waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, headers, raw = server.request("POST", "/v1/completions", {**long, "max_tokens": 2})
    assert status == 429 and headers["retry-after"] == "1", raw
    assert json.loads(raw)["error"]["code"] == "queue_full"
    assert server.json("GET", "/health", auth=False)[0] == 200
    while (event := next_event(resp)) != "[DONE]":  # the long one runs to its end
        last = event
    conn.close()
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 1000
    t.join(60)
    assert waiting["r"][0] == 200 and len(waiting["r"][1]["choices"][0]["token_ids"]) == 2


def test_metrics_parse_and_hold_the_runtime_series(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=model_name(server), prompt=[1, 2, 3], max_tokens=3)
    _, headers, raw = server.request("GET", "/metrics")
    assert headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    bubble = families["pp_runtime_stage_bubble_seconds"]
    assert bubble.type == "counter"
    assert {(s.labels["stage"], s.labels["cause"]) for s in bubble.samples if s.name.endswith("_total")} \
        == {("0", c) for c in ("upstream", "downstream", "dependency")}
    for name in ("pp_runtime_stage_busy_seconds", "pp_runtime_stage_wall_seconds",
                 "pp_runtime_generation_tokens", "pp_runtime_prompt_tokens"):
        assert sum(s.value for s in families[name].samples if s.name.endswith("_total")) > 0, name
    for name in ("pp_runtime_request_ttft_seconds", "pp_runtime_request_tbt_seconds",
                 "pp_runtime_request_bubble_seconds"):
        assert families[name].type == "histogram"
        assert next(s.value for s in families[name].samples if s.name.endswith("_count")) > 0, name
    assert families["pp_runtime_queue_depth"].type == "gauge"
    assert families["pp_runtime_requests_running"].samples[0].value == 0
    assert families["pp_runtime_stage_bubble_fraction"].type == "gauge"
