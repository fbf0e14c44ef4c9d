"""A hybrid micro-batch (a prefill chunk + decodes of other requests) gives every request
the logits it gets alone: the fused linear layers mix rows, attention must not."""
import pytest
import torch

from conftest import slot_tables
from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
from pp_runtime.config import Config, load_model_config
from pp_runtime.worker.stage import StageWorker

GREEDY = Sampling(0.0, 1.0, 0)


def worker(family: str) -> StageWorker:
    model = load_model_config("tiny-gpt" if family == "gpt" else "tiny-llama")
    return StageWorker(Config(model=model).with_overrides(kv_slots=8), 0, torch.device("cpu"))


def logits(w, seqs):
    hidden, _ = w.forward(MicroBatch(0, slot_tables(seqs, w.cfg)), None)
    return w.model.logits(hidden)


def prompts():
    g = torch.Generator().manual_seed(11)
    return {rid: torch.randint(0, 512, (n,), generator=g).tolist()
            for rid, n in ((0, 30), (1, 21), (2, 45), (3, 12))}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_hybrid_batch_matches_each_request_alone(family):
    p = prompts()
    hybrid, alone = worker(family), worker(family)  # same seed, same weights
    # requests 0, 1, 3 are past their prompts (prefilled whole); request 2 is being chunked
    for w in (hybrid, alone):
        for rid in (0, 1, 3):
            logits(w, [SeqChunk(rid, rid, 0, tuple(p[rid][:-1]), None)])
        logits(w, [SeqChunk(2, 2, 0, tuple(p[2][:16]), None)])
    # one micro-batch: decodes of 0, 1, 3 (their last prompt token) + chunk [16, 40) of 2
    decodes = [SeqChunk(rid, rid, len(p[rid]) - 1, (p[rid][-1],), GREEDY, is_decode=True)
               for rid in (0, 1, 3)]
    chunk = SeqChunk(2, 2, 16, tuple(p[2][16:40]), None)
    mixed = logits(hybrid, decodes + [chunk])  # [3 + 24, vocab]
    for i, d in enumerate(decodes):
        torch.testing.assert_close(mixed[i], logits(alone, [d])[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[3:], logits(alone, [chunk]), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_two_prefill_chunks_and_decodes_in_one_batch(family):
    """Attention keeps any number of prefill spans apart (the planners that batch several
    prefills, like orca, rely on it)."""
    p = prompts()
    hybrid, alone = worker(family), worker(family)
    for w in (hybrid, alone):
        logits(w, [SeqChunk(0, 0, 0, tuple(p[0][:-1]), None)])
    seqs = [SeqChunk(0, 0, 29, (p[0][-1],), GREEDY, is_decode=True),
            SeqChunk(1, 1, 0, tuple(p[1]), GREEDY),
            SeqChunk(3, 3, 0, tuple(p[3]), GREEDY)]
    mixed = logits(hybrid, seqs)
    expected = torch.cat([logits(alone, [s]) for s in seqs])
    torch.testing.assert_close(mixed, expected, atol=2e-5, rtol=1e-5)
