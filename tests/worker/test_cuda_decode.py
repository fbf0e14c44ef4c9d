"""The CUDA decode path on a GPU: the paged Triton kernel against the gather (varlen
FlashAttention) path and an fp32 reference, CUDA-graph replays against the eager stage,
and the host syncs a micro-batch costs (`torch.cuda.set_sync_debug_mode("warn")`).
Skipped without a GPU; benchmarks/gpu_check.py runs them (docs/gpu.md)."""
import warnings

import pytest
import torch

from conftest import slot_tables
from pp_runtime.config import load_config
from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
from pp_runtime.model.attention import BatchLayout, decode_attention, decode_attention_views

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = Sampling(0.0, 1.0, 0)
CUDA = torch.device("cuda")


@pytest.mark.parametrize("heads, kv_heads, window", [(8, 8, None), (32, 8, None), (16, 4, 100)],
                         ids=["mha", "gqa", "window"])
def test_paged_kernel_equals_gather_and_fp32(heads, kv_heads, window):
    pytest.importorskip("triton")
    from pp_runtime.model.kv_cache import KVCache

    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 400, 16, kv_heads, 128, torch.bfloat16, CUDA)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    lens = torch.randint(1, 700, (16,), generator=g).tolist()
    perm = torch.randperm(400, generator=g).tolist()  # blocks scattered over the pool
    seqs, at = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // 16)
        seqs.append(SeqChunk(i, perm[at:at + nb], n - 1, (1,), GREEDY, is_decode=True))
        at += nb
    mb = MicroBatch(0, tuple(seqs))
    q = torch.randn(16, heads, 128, generator=g).to(torch.bfloat16).to(CUDA)
    paged = decode_attention(q, cache.k[0], cache.v[0], BatchLayout.build(mb, CUDA, 16, paged=True), window)
    gather = decode_attention(q, cache.k[0], cache.v[0], BatchLayout.build(mb, CUDA, 16), window)
    ref = decode_attention_views(q.float(), cache.k[0].float(), cache.v[0].float(),
                                 BatchLayout.build(mb, CUDA, 16), window)
    err_paged, err_gather = ((x.float() - ref).abs().max().item() for x in (paged, gather))
    print(f"max error vs fp32: paged {err_paged:.4f}, gather {err_gather:.4f}")
    assert err_paged <= max(2 * err_gather, 1e-2)


def _worker(**fields):
    from pp_runtime.worker.stage import StageWorker

    cfg = load_config("tiny").with_overrides(max_batch_size=8, device="cuda", dtype="bfloat16",
                                             family="llama", num_kv_heads=2, **fields)
    return cfg, StageWorker(cfg, 0, CUDA)


def _prefilled(lens, **fields):
    cfg, w = _worker(**fields)
    g = torch.Generator().manual_seed(3)
    for slot, n in enumerate(lens):
        ids = tuple(torch.randint(1, 200, (n,), generator=g).tolist())
        w.execute(MicroBatch(slot, slot_tables([SeqChunk(slot, slot, 0, ids, GREEDY)], cfg)))
    return cfg, w


def test_graph_replays_equal_the_eager_stage():
    """Five decodes (bucket 8), two steps: the second replay reads the new inputs."""
    from pp_runtime.worker.graphs import graph_counts

    lens = [9, 30, 17, 64, 3]
    cfg, eager = _prefilled(lens, cuda_graphs=False)
    _, graph = _prefilled(lens)
    assert graph.graphs is not None and eager.graphs is None
    before = graph_counts()
    for step in range(2):
        seqs = tuple(SeqChunk(s, s, n + step, (5 + s + step,), GREEDY, is_decode=True)
                     for s, n in enumerate(lens))
        mb = MicroBatch(10 + step, slot_tables(seqs, cfg))
        want, got = eager.compute(mb, None)[1], graph.compute(mb, None)[1]
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    after = graph_counts()
    assert (after["captures"] - before["captures"], after["replays"] - before["replays"]) == (1, 2)


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_host_syncs_per_micro_batch(graphs):
    """A decode-only micro-batch on the last stage syncs once (the sampled ids come back);
    torch's sync debug mode counts every synchronizing call."""
    lens = [9, 30, 17]
    cfg, w = _prefilled(lens, cuda_graphs=graphs)
    counts = []
    for step in range(3):
        seqs = tuple(SeqChunk(s, s, n + step, (5,), GREEDY, is_decode=True) for s, n in enumerate(lens))
        mb = MicroBatch(10 + step, slot_tables(seqs, cfg))
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                w.execute(mb)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(x.message) for x in seen))
    print(f"host syncs per decode-only micro-batch ({'graph' if graphs else 'eager'}): {counts}")
    assert counts[-1] <= 1


def test_compiled_small_ops_match_the_eager_ones():
    """RMSNorm, RoPE and SwiGLU through torch.compile (the CUDA default) give the eager
    logits of a hybrid micro-batch to bf16 rounding."""
    from pp_runtime.model.transformer import compile_small_ops

    lens = [9, 30]
    cfg, w = _prefilled(lens, cuda_graphs=False)
    seqs = tuple(SeqChunk(s, s, n, (5,), GREEDY, is_decode=True) for s, n in enumerate(lens))
    mb = MicroBatch(10, slot_tables(seqs + (SeqChunk(2, 2, 0, tuple(range(1, 20)), GREEDY),), cfg))
    outs = []
    try:
        for on in (False, True):
            compile_small_ops(on)
            outs.append(w.compute(mb, None)[1])
    finally:
        compile_small_ops(True)
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
