"""Chunked prefill is mathematically a full prefill (paper Fig. 6), on both families."""
import pytest
import torch

from conftest import slot_tables
from pp_runtime.core.batch import MicroBatch, SeqChunk
from pp_runtime.config import Config, load_model_config
from pp_runtime.worker.stage import StageWorker

PROMPT_LEN = 70


def make_worker(family: str) -> StageWorker:
    model = load_model_config("tiny-gpt" if family == "gpt" else "tiny-llama")
    cfg = Config(model=model).with_overrides(kv_slots=4)
    return StageWorker(cfg, 0, torch.device("cpu"))


def run_logits(worker: StageWorker, seqs) -> torch.Tensor:
    hidden, _ = worker.forward(MicroBatch(0, slot_tables(seqs, worker.cfg)), None)
    return worker.model.logits(hidden)  # [num_tokens, vocab]


def prefill_in_chunks(worker, prompt, chunk, slot=0) -> torch.Tensor:
    out = []
    for start in range(0, len(prompt), chunk):
        ids = tuple(prompt[start:start + chunk])
        out.append(run_logits(worker, [SeqChunk(7, slot, start, ids, None)]))
    return torch.cat(out)  # [len(prompt), vocab]


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_full_prefill(family, chunk):
    worker = make_worker(family)
    prompt = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    full = prefill_in_chunks(worker, prompt, PROMPT_LEN, slot=0)
    chunked = prefill_in_chunks(worker, prompt, chunk, slot=1)
    assert full.shape == (PROMPT_LEN, 512)
    torch.testing.assert_close(chunked, full, atol=2e-5, rtol=1e-5)
    # and the logits really depend on the context: a wrong mask would not pass this
    assert not torch.allclose(full[10], full[11], atol=1e-3)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_decode_path_equals_full_prefill(family):
    """Feeding the prompt one token at a time through the decode attention path gives
    the full prefill's logits."""
    worker = make_worker(family)
    prompt = list(range(5, 5 + 30))
    full = prefill_in_chunks(worker, prompt, len(prompt), slot=0)
    first = run_logits(worker, [SeqChunk(1, 1, 0, (prompt[0],), None)])
    from pp_runtime.core.batch import Sampling
    greedy = Sampling(0.0, 1.0, 0)
    steps = [run_logits(worker, [SeqChunk(1, 1, pos, (prompt[pos],), greedy, is_decode=True)])
             for pos in range(1, len(prompt))]
    torch.testing.assert_close(torch.cat([first, *steps]), full, atol=2e-5, rtol=1e-5)
