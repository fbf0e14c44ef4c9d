"""The torchrun control channel's format carries real plans and results unchanged, and
refuses anything else: a pickle (which would run code on unpickling), unknown or missing
fields, wrong types."""
import json
import pickle

import pytest

from pp_runtime.core.batch import MicroBatch, RankResult, SampledTokens, Sampling, SeqChunk, StageTiming
from pp_runtime.config import load_config
from pp_runtime.planner import make_planner
from pp_runtime.core.request import Request, SamplingParams
from pp_runtime.executors.wire import PLAN, RESULT, WireError, decode, encode


def real_plans(n=12):
    """Micro-batches from the SARATHI planner: prefill chunks, decodes, greedy and seeded."""
    planner = make_planner(load_config("tiny", chunk_size=16, max_batch_size=4))
    for rid, (prompt_len, temperature) in enumerate([(37, 0.0), (5, 0.8), (20, 1.0)]):
        params = SamplingParams(max_tokens=4, temperature=temperature, top_p=0.9, seed=rid)
        planner.add(Request(rid, list(range(1, prompt_len + 1)), params, seed=rid))
    plans = []
    while len(plans) < n and (mb := planner.schedule(0.0)) is not None:
        plans.append(mb)
        tokens = {s.request_id: 3 for s in mb.seqs if s.sampling is not None}
        planner.on_result(mb, SampledTokens(mb.mb_id, tokens), 0.0)
    return plans


def test_real_microbatches_round_trip():
    plans = real_plans()
    assert any(s.is_decode for mb in plans for s in mb.seqs)
    assert any(s.sampling is None for mb in plans for s in mb.seqs)
    for mb in plans:
        mb = MicroBatch(mb.mb_id, mb.seqs, idle_before_s=0.125)
        data = encode(mb, PLAN)
        assert decode(data, PLAN) == mb
        json.loads(data)  # plain JSON


def test_results_and_stop_round_trip():
    timing = StageTiming(4, 1, 0, 0.001, 0.002, 10.5, 10.75, 0.003)
    for tokens in ({17: 5, 3: 50256}, {}, None):
        result = RankResult(timing, tokens)
        assert decode(encode(result, RESULT), RESULT) == result
    assert decode(encode(None, PLAN), PLAN) is None


def test_a_pickle_is_refused_and_never_unpickled():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("a pickle from the control channel was unpickled",))

    mb = real_plans(1)[0]
    for payload in (pickle.dumps(mb), pickle.dumps(Boom()), pickle.dumps(mb, protocol=0)):
        with pytest.raises(WireError, match="not a JSON control message"):
            decode(payload, PLAN)


def _plan_dict():
    return json.loads(encode(real_plans(1)[0], PLAN))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(extra=1), r"unknown: \['extra'\]"),
    (lambda d: d.pop("idle_before_s"), r"missing: \['idle_before_s'\]"),
    (lambda d: d.update(mb_id="3"), r"message.mb_id: expected int, got str"),
    (lambda d: d.update(mb_id=3.0), r"message.mb_id: expected int, got float"),
    (lambda d: d.update(mb_id=True), r"message.mb_id: expected int, got bool"),
    (lambda d: d["seqs"][0].update(token_ids=[1, "os.system"]),
     r"message.seqs\[0\].token_ids\[1\]: expected int"),
    (lambda d: d["seqs"][0].update(is_decode=0), r"is_decode: expected bool"),
    (lambda d: d["seqs"][0].update(sampling={"temperature": 1.0, "top_p": 1.0}),
     r"message.seqs\[0\].sampling: fields do not match"),
    (lambda d: d.update(seqs={"py/object": "os.system"}), r"message.seqs: expected"),
])
def test_wrong_fields_and_types_are_refused_by_path(mutate, message):
    d = _plan_dict()
    mutate(d)
    with pytest.raises(WireError, match=message):
        decode(json.dumps(d).encode(), PLAN)


def test_a_message_of_the_wrong_kind_is_refused():
    timing = StageTiming(0, 0, 0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(WireError, match=r"unknown: \['timing', 'tokens'\]"):
        decode(encode(RankResult(timing, {1: 2}), RESULT), PLAN)
    good = json.loads(encode(RankResult(timing, {1: 2}), RESULT))
    with pytest.raises(WireError, match=r"message.tokens\['x'\] key: expected int, got str"):
        decode(json.dumps({**good, "tokens": {"x": 2}}).encode(), RESULT)  # keys are text
    with pytest.raises(WireError, match=r"missing: \['timing'\]"):
        decode(b'{"tokens": null}', RESULT)


def test_encode_checks_too_and_takes_numpy_ints():
    np = pytest.importorskip("numpy")
    mb = MicroBatch(np.int64(1), (SeqChunk(0, [np.int64(4), 2], 0, tuple(np.arange(3)),
                                           Sampling(0.0, 1.0, 0)),))
    assert decode(encode(mb, PLAN), PLAN) == MicroBatch(1, (SeqChunk(0, [4, 2], 0, (0, 1, 2),
                                                                     Sampling(0.0, 1.0, 0)),))
    with pytest.raises(WireError, match=r"message.seqs\[0\].token_ids\[0\]: cannot send float"):
        encode(MicroBatch(1, (SeqChunk(0, [0], 0, (1.5,), None),)), PLAN)
    with pytest.raises(WireError, match=r"message.seqs\[0\].blocks\[0\]: cannot send float"):
        encode(MicroBatch(1, (SeqChunk(0, [0.5], 0, (1,), None),)), PLAN)
    with pytest.raises(WireError, match="cannot send"):
        encode(object(), PLAN)
