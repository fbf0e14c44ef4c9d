"""The online engine (`engine/online.py`): callers on many threads share one planner and its KV
slots and get offline `generate`'s tokens; an abort frees its slot for the next request;
streams deliver each token, then the output and its timing; an executor failure ends every
open request with `error`; the bounded queue refuses, the idle loop sleeps."""
import threading
import time

import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.engine.online import Engine, EngineClosed, Finished, QueueFull, Token
from pp_runtime.core.request import FinishReason, InvalidRequestError

PROMPTS = [[(7 * i + j) % 512 for j in range(n)] for i, n in enumerate((40, 5, 90, 17, 33, 64, 8, 21))]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
TINY = dict(chunk_size=16, max_batch_size=2, tile_size=16, pp=2, executor="local")


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", **TINY) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def one_slot(**overrides) -> LLM:
    """A pipeline with a single KV slot (one whole context, `paged: false`): a second
    request runs only once the first is gone."""
    return LLM("tiny", **{**dict(chunk_size=16, tile_size=16, max_batch_size=1, pp=1,
                                  executor="local", paged=False), **overrides})


def test_callers_on_many_threads_share_the_blocks_and_get_offline_tokens(llm, reference):
    """8 requests from 4 threads at once on one paged KV pool: each gets exactly the tokens
    of the offline batch; no block is in two sequences of a micro-batch, and a block passes
    from one request to the next only after the first ended (never back and forth)."""
    engine, got, errors = llm.engine, {}, []
    block_users: dict[int, list[int]] = {}
    bs = llm.config.cache.block_size
    seen, problems = [], []  # what the watcher saw and found, asserted on this thread

    def record(mb, out):
        """On the engine thread, which swallows what a watcher raises (it only unwatches
        it): every problem, an unexpected error included, is kept for the test thread."""
        try:
            seen.append(mb.mb_id)
            tables = [s.blocks[:-(-s.kv_len // bs)] for s in mb.seqs]
            used = [b for t in tables for b in t]
            if len(used) != len(set(used)):
                problems.append(f"micro-batch {mb.mb_id} holds a block twice")
            for s, table in zip(mb.seqs, tables):
                for b in table:
                    users = block_users.setdefault(b, [])
                    if not users or users[-1] != s.request_id:
                        users.append(s.request_id)
        except Exception as exc:  # pragma: no cover - reported below
            problems.append(f"the watcher failed: {type(exc).__name__}: {exc}")

    watcher = engine.watch(record)

    def client(indices):
        try:
            handles = {i: engine.add_request(PROMPTS[i], GREEDY, seed=0) for i in indices}
            for i, h in handles.items():
                got[i] = h.result(timeout=60).output.token_ids
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=([k, k + 4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engine.unwatch(watcher)
    assert not errors
    assert watcher.error is None and not problems, problems
    assert seen, "the watcher saw no micro-batch"
    assert [got[i] for i in range(len(PROMPTS))] == reference
    assert len(block_users) <= engine._planner.kv.pool.num_blocks
    for users in block_users.values():  # each owner held a block in one stretch
        assert len(users) == len(set(users))
    assert len({r for u in block_users.values() for r in u}) == len(PROMPTS)


def test_two_generate_calls_at_once_share_one_planner(llm, reference):
    outs = {}
    threads = [threading.Thread(target=lambda k=k: outs.__setitem__(k, llm.generate(PROMPTS, GREEDY)))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [o.token_ids for o in outs[0]] == reference == [o.token_ids for o in outs[1]]
    assert not llm.engine.num_running() and not llm.engine.num_waiting()


def test_a_stream_gives_each_token_then_the_output_and_its_timing(llm, reference):
    handle = llm.engine.add_request(PROMPTS[2], GREEDY, request_id="r-stream", seed=0)
    events = list(handle.events())
    tokens, final = events[:-1], events[-1]
    assert all(isinstance(e, Token) and e.request_id == "r-stream" for e in tokens)
    assert isinstance(final, Finished) and final.request_id == "r-stream"
    assert [e.token_id for e in tokens] == final.output.token_ids == reference[2]
    assert final.output.finish_reason == FinishReason.LENGTH
    t = final.timing
    assert t.queue_s >= 0 and t.ttft_s >= t.queue_s and t.generation_s > 0
    assert t.bubble_s == 0  # in one process a stage never waits for another (see the sim test)


def test_abort_frees_the_slot_for_the_next_request():
    with one_slot() as llm:
        engine, first = llm.engine, threading.Event()
        long = engine.add_request([1] * 10, SamplingParams(max_tokens=200, ignore_eos=True),
                                  request_id="long", listener=lambda e: first.set())
        assert first.wait(30)  # it holds the only slot
        waiting = engine.add_request([2] * 10, SamplingParams(max_tokens=3, ignore_eos=True))
        assert engine.num_waiting() == 1
        assert engine.abort("long")
        assert long.result(30).output.finish_reason == FinishReason.ABORTED
        assert len(long.finished.output.token_ids) < 200
        out = waiting.result(30).output  # runs only if the slot came back
        assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3
        assert not engine.abort("long")  # already ended


def test_abort_of_a_waiting_request_ends_it_at_once():
    with one_slot() as llm:
        engine, first = llm.engine, threading.Event()
        running = engine.add_request([1] * 10, SamplingParams(max_tokens=60, ignore_eos=True),
                                     listener=lambda e: first.set())
        assert first.wait(30)
        waiting = engine.add_request([2] * 10, GREEDY, request_id="w")
        engine.abort("w")
        out = waiting.result(30).output
        assert out.finish_reason == FinishReason.ABORTED and out.token_ids == []
        assert waiting.finished.timing.queue_s is None  # it never ran
        assert running.result(30).output.finish_reason == FinishReason.LENGTH


def test_a_full_queue_refuses_and_a_bad_request_runs_nothing():
    with one_slot() as llm:
        engine = Engine(llm.config, llm.executor, max_waiting=1)
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            engine.add_request([], GREEDY)
        assert engine._thread is None  # nothing started
        first = threading.Event()
        a = engine.add_request([1] * 10, SamplingParams(max_tokens=60, ignore_eos=True),
                               listener=lambda e: first.set())
        assert first.wait(30)
        b = engine.add_request([2] * 10, GREEDY)
        deadline = time.monotonic() + 30
        while engine.num_queued() < 1:  # the engine tried to admit it: it waits for KV
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(QueueFull):
            engine.add_request([3] * 10, GREEDY)
        assert a.result(30).output.finish_reason == b.result(30).output.finish_reason == "length"
        engine.close()
        with pytest.raises(EngineClosed):
            engine.add_request([1], GREEDY)


def test_max_waiting_counts_only_requests_the_kv_blocks_cannot_take():
    """A burst the free blocks hold is never refused (8 at once on an idle pool of 16
    contexts with max_waiting 4); max_waiting 0 serves what fits and queues nothing."""
    with one_slot(kv_slots=16, max_batch_size=8) as llm:
        engine = Engine(llm.config, llm.executor, max_waiting=4)
        handles = [engine.add_request([k + 1] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
                   for k in range(8)]
        assert [h.result(60).output.finish_reason for h in handles] == ["length"] * 8
        engine.close()
    with one_slot() as llm:
        engine = Engine(llm.config, llm.executor, max_waiting=0)
        first = threading.Event()
        a = engine.add_request([1] * 10, SamplingParams(max_tokens=60, ignore_eos=True),
                               listener=lambda e: first.set())
        assert first.wait(30)  # served: 0 is no queue, not no service
        b = engine.add_request([2] * 10, GREEDY).result(30)  # no block free: refused
        assert b.output.finish_reason == FinishReason.ABORTED and b.refused
        assert a.result(30).output.finish_reason == "length"
        engine.close()


def test_an_executor_failure_ends_every_open_request_with_error():
    llm = one_slot(max_batch_size=2)
    worker, calls = llm.executor.workers[0], [0]
    real = worker.execute

    def failing(mb, *args, **kwargs):  # the stage dies on its 5th micro-batch
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("stage 0 rank 0 died")
        return real(mb, *args, **kwargs)

    worker.execute = failing
    engine = llm.engine
    handles = [engine.add_request([k + 1] * 30, SamplingParams(max_tokens=20, ignore_eos=True))
               for k in range(3)]  # two run, one waits for a slot
    outs = [h.result(30).output for h in handles]
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR] * 3
    assert all("stage 0 rank 0 died" in o.error for o in outs)
    assert not engine.healthy
    with pytest.raises(EngineClosed, match="stage 0 rank 0 died"):
        engine.add_request([1], GREEDY)
    llm.shutdown()


def test_an_idle_engine_sleeps_until_a_request_comes():
    with one_slot() as llm:
        engine, pulls = llm.engine, [0]
        intake = engine._intake  # the loop's driver.Intake (engine/intake.py)
        pull = intake.pull

        def counting(planner, now):
            pulls[0] += 1
            return pull(planner, now)

        intake.pull = counting
        engine.add_request([1, 2, 3], GREEDY).result(30)
        time.sleep(0.1)
        before = pulls[0]
        time.sleep(0.5)
        assert pulls[0] == before  # asleep on the condition, not polling
        handle = engine.add_request([1, 2, 3], GREEDY)
        assert handle.result(30).output.finish_reason == "length"
        assert pulls[0] > before


def test_the_simulators_executor_runs_under_the_engine():
    """The same engine over `SimExecutor` and its virtual clock: requests arriving later
    are held back on that clock, and the idle stretch before them reaches the stages."""
    from pp_runtime.config import load_config
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.executors.sim import SimExecutor, VirtualClock
    from pp_runtime.telemetry.recorder import RunRecorder

    cfg = load_config("tiny", pp=2, chunk_size=16, tile_size=16)
    clock = VirtualClock()
    engine = Engine(cfg, SimExecutor(build_cost_model(cfg), 2, clock), clock=clock,
                    sleep=clock.sleep)
    idle, rec = [], RunRecorder(clock)
    watcher = engine.watch(lambda mb, out: (idle.append(mb.idle_before_s), rec(mb, out)))
    first = engine.add_request([1] * 60, GREEDY).result(30)
    assert first.output.token_ids == [0] * 6
    # its bubble is the recorder's: stage 1 waited for stage 0 on every micro-batch
    assert first.timing.bubble_s == pytest.approx(rec.request_bubble_s[first.output.request_id])
    assert first.timing.bubble_s > 0
    late = engine.add_request([1] * 20, GREEDY, arrival_s=clock() + 5.0)
    out = late.result(30).output
    assert out.finish_reason == "length" and out.arrival_s >= 5.0 and out.first_token_s > out.arrival_s
    assert max(idle) >= 4.0  # the wait for the late arrival was idle time
    assert watcher.error is None  # the engine swallows a watcher's error: look
    engine.close()
