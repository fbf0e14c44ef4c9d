"""`pp-runtime serve` over a PP=2 Ray deployment (two stage actors, gloo, 127.0.0.1): 32
concurrent streaming clients all finish with the right token counts; /metrics has the
bubble series of both stages by cause; a stage worker killed with SIGKILL is replaced and
every open stream finishes with the tokens of a fault-free run."""
import asyncio
import os
import re
import signal
import time

import pytest

from running_server import Server, cmdline, descendants

pytestmark = pytest.mark.slow  # Ray actors or torchrun processes (pytest.ini)

openai = pytest.importorskip("openai")
pytest.importorskip("ray")

KEY = "ray-key"
FLAGS = ["--config", "tiny", "--set", "executor=ray", "--set", "pp=2", "--set", "threads_per_worker=1",
         "--set", "chunk_size=16", "--set", "tile_size=16", "--set", "max_batch_size=4"]


@pytest.fixture(scope="module")
def server():
    srv = Server(*FLAGS, api_key=KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_32_concurrent_streams_all_finish_with_their_token_counts(server):
    async def one(c, i):
        n = 3 + i % 6
        stream = await c.completions.create(model="tiny-gpt", prompt=[1 + i] * (5 + 3 * i),
                                            max_tokens=n, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        return n, [t for ch in chunks for t in ch.choices[0].token_ids], chunks[-1]

    async def all_of_them():
        c = client(server)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(32)))
        finally:
            await c.close()

    results = asyncio.run(all_of_them())
    for n, tokens, last in results:
        assert len(tokens) == n
        assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == n
        assert last.pp_runtime["ttft_s"] > 0
    # 8 KV slots for 32 requests: most waited, and the pipeline's stages waited on each other
    assert max(last.pp_runtime["queue_s"] for _, _, last in results) > 0
    assert sum(last.pp_runtime["bubble_s"] for _, _, last in results) > 0


def test_metrics_have_both_stages_bubbles_by_cause(server):
    from prometheus_client.parser import text_string_to_metric_families

    _, _, raw = server.request("GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    bubble = {(s.labels["stage"], s.labels["cause"]): s.value
              for s in families["pp_runtime_stage_bubble_seconds"].samples if s.name.endswith("_total")}
    assert set(bubble) == {(st, c) for st in "01" for c in ("upstream", "downstream", "dependency")}
    assert bubble["1", "upstream"] > 0  # stage 1 waits for stage 0
    assert bubble["0", "dependency"] > 0  # stage 0 waits for sampled tokens
    busy = {s.labels["stage"]: s.value for s in families["pp_runtime_stage_busy_seconds"].samples
            if s.name.endswith("_total")}
    assert busy.keys() == {"0", "1"} and min(busy.values()) > 0
    assert all(s.labels["deployment"] == "tiny-gpt-tp1xpp2" for s in bubble_samples(families))


def bubble_samples(families):
    return families["pp_runtime_stage_bubble_seconds"].samples


def stage_actor_pids(server) -> list[int]:
    """The server's Ray stage actors: processes titled `ray::StageActor` when idle and
    `ray::stage<S>-tp<R>.execute` while they run a micro-batch."""
    return [p for p in descendants(server.proc.pid)
            if re.match(r"ray::(StageActor|stage\d+-tp\d+\.)", cmdline(p))]


def test_a_killed_stage_worker_is_replaced_and_every_stream_finishes_with_all_its_tokens(server):
    """A stage worker killed with SIGKILL mid-stream: the engine replaces the workers,
    /health says "recovering" meanwhile, then "ok"; every stream goes on where it
    stopped, no token twice or missing: the tokens equal a fault-free run's (greedy)."""
    prompts = [[7 + i] * 20 for i in range(3)]
    want = {}
    for i, prompt in enumerate(prompts):  # before the fault
        status, ref = server.json("POST", "/v1/completions", {
            "model": "tiny-gpt", "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, ref
        want[i] = ref["choices"][0]["token_ids"]

    async def stream(c, i, started):
        s = await c.completions.create(model="tiny-gpt", prompt=prompts[i], max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
        tokens, last = [], None
        async for ch in s:
            tokens += ch.choices[0].token_ids
            last = ch
            started.set()
        return tokens, last.choices[0].finish_reason

    async def health_seen(stop, seen):
        while not stop.is_set():
            seen.append((await asyncio.to_thread(server.json, "GET", "/health", auth=False))[1]["status"])
            await asyncio.sleep(0.1)

    async def kill_while_streaming():
        c, started, stop, seen = client(server), asyncio.Event(), asyncio.Event(), []
        tasks = [asyncio.create_task(stream(c, i, started)) for i in range(3)]
        await asyncio.wait_for(started.wait(), 60)
        pids = stage_actor_pids(server)
        assert len(pids) == 2, "\n".join(f"{p} {cmdline(p)[:70]}" for p in descendants(server.proc.pid))
        os.kill(pids[-1], signal.SIGKILL)
        poll = asyncio.create_task(health_seen(stop, seen))
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks), 120), seen
        finally:
            stop.set()
            await poll
            await c.close()

    results, seen = asyncio.run(kill_while_streaming())
    for i, (tokens, reason) in enumerate(results):
        assert reason == "length" and tokens == want[i], (i, len(tokens))
    deadline = time.monotonic() + 30  # an idle server's probe finds the death too
    while (health := server.json("GET", "/health", auth=False))[1].get("recoveries", 0) < 1:
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert health[0] == 200 and health[1]["status"] == "ok", health
    assert "recovering" in seen and seen[-1] == "ok", seen
    _, _, raw = server.request("GET", "/metrics")
    assert re.search(r'pp_runtime_recoveries_total\{deployment="tiny-gpt-tp1xpp2",stage="[01]"\} 1\.0',
                     raw.decode()), raw.decode()[-2000:]
    assert len(stage_actor_pids(server)) == 2  # replaced, none left over
