"""Decode-only micro-batches through the CUDA graphs' static buffers (worker/graphs.py) and
the paged decode kernel (model/paged_kernel.py), checked on a CPU: the buckets by hand,
the graph path's logits against the eager path's, the padding against the cache it must
not touch, and the Triton kernel (under TRITON_INTERPRET=1, where Triton is installed)
against the other decode paths. Capture and replay themselves need a GPU
(benchmarks/gpu_check.py, docs/gpu.md)."""
import os

import pytest
import torch

from conftest import slot_tables
from pp_runtime.config import load_config
from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
from pp_runtime.model.attention import BatchLayout, decode_attention_views
from pp_runtime.model.cpu_kernels import decode_extension
from pp_runtime.worker.graphs import bucket_for, buckets, graph_counts
from pp_runtime.worker.stage import StageWorker

GREEDY = Sampling(0.0, 1.0, 0)
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(decode_extension() is None, reason="no C++ compiler here")


def test_buckets_by_hand():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(1) == [1] and buckets(3) == [1, 2, 3] and buckets(8) == [1, 2, 4, 8]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    sizes = buckets(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 64, 65)] == [1, 4, 8, 16, 64, None]


def _workers(graphs_on: bool, **fields):
    cfg = load_config("tiny").with_overrides(max_batch_size=6, device="cpu", cuda_graphs=graphs_on,
                                             graph_max_decodes=8, **fields)
    return cfg, StageWorker(cfg, 0, CPU)


def _prefill(worker, cfg, lens):
    g = torch.Generator().manual_seed(3)
    for slot, n in enumerate(lens):
        ids = tuple(torch.randint(1, 200, (n,), generator=g).tolist())
        worker.execute(MicroBatch(slot, slot_tables([SeqChunk(slot, slot, 0, ids, GREEDY)], cfg)))


@needs_kernel
def test_graph_path_gives_the_eager_logits_and_writes_only_its_rows():
    """Three decodes (bucket 4: one padded row) over contexts of 9, 30 and 17 keys: the
    static-buffer path's logits equal the eager path's; afterwards the two caches are
    equal everywhere but the scratch block, which only the padding wrote."""
    lens = (9, 30, 17)
    cfg, eager = _workers(False)
    _, graph = _workers(True)
    assert eager.graphs is None and graph.graphs is not None
    for w in (eager, graph):
        _prefill(w, cfg, lens)
    decodes = tuple(SeqChunk(s, s, n, (5 + s,), GREEDY, is_decode=True) for s, n in enumerate(lens))
    mb = MicroBatch(9, slot_tables(decodes, cfg))
    assert graph.graphs.bucket(mb) == 4
    before = graph_counts()
    want = eager.compute(mb, None)[1]
    got = graph.compute(mb, None)[1]
    after = graph_counts()
    assert after["uncaptured"] == before["uncaptured"] + 1
    assert after["padded_rows"] == before["padded_rows"] + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    scratch = graph.cache.scratch_block
    for a, b in zip(eager.cache.k + eager.cache.v, graph.cache.k + graph.cache.v):
        assert torch.equal(a[:scratch], b[:scratch])  # every request's keys and values
        assert b[scratch].abs().sum() > 0 and a[scratch].abs().sum() == 0  # padding went here


@needs_kernel
def test_what_does_not_fit_a_graph_runs_eagerly():
    cfg, worker = _workers(True)
    graphs = worker.graphs
    prefill = SeqChunk(0, 0, 0, (1, 2, 3), GREEDY)
    decode = SeqChunk(1, 1, 4, (9,), GREEDY, is_decode=True)
    assert graphs.bucket(MicroBatch(0, slot_tables([prefill, decode], cfg))) is None  # a prompt chunk
    many = [SeqChunk(i, i % 6, 4, (9,), GREEDY, is_decode=True) for i in range(9)]
    assert graphs.bucket(MicroBatch(0, slot_tables(many, cfg))) is None  # past the largest bucket
    no_sampling = SeqChunk(1, 1, 4, (9,), None, is_decode=True)
    assert graphs.bucket(MicroBatch(0, slot_tables([no_sampling], cfg))) is None  # last stage samples all


def test_graphs_true_needs_tables_in_tensors():
    from pp_runtime.core.errors import ConfigError

    with pytest.raises(ConfigError, match="runtime.cuda_graphs"):
        _workers(True, cpu_decode_kernel=False)
    assert _workers("auto")[1].graphs is None  # auto: CUDA only


# ---- the paged Triton kernel, run by Triton's interpreter on this CPU ---------------------
def _triton_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on a CPU only with TRITON_INTERPRET=1 set at start")
    pytest.importorskip("triton")


def test_splits_by_hand():
    from pp_runtime.model.paged_kernel import splits

    assert splits(2560, 1024, 128, 132) == (1, 1024)  # 64 decodes x 40 heads fill an H200
    assert splits(160, 1024, 128, 132) == (4, 256)  # 4 x 40: 4 splits of 2 tiles
    assert splits(160, 2048, 128, 132) == (4, 512)
    assert splits(8, 65536, 128, 132) == (16, 4096)  # at most 16
    assert splits(160, 200, 128, 132) == (1, 200)  # under two tiles: one pass


@pytest.mark.parametrize("sms", [None, 64], ids=["one-pass", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, window, heads_major", [
    (4, 4, 64, None, False), (8, 2, 80, None, False), (8, 2, 64, 5, False), (4, 2, 32, None, True)],
    ids=["mha", "gqa-hd80", "window", "heads-major"])
def test_paged_kernel_equals_the_gather_path(dtype, heads, kv_heads, head_dim, window, heads_major, sms):
    _triton_interpreter()
    from pp_runtime.model.kv_cache import KVCache
    from pp_runtime.model.paged_kernel import paged_decode

    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 12, 4, kv_heads, head_dim, dtype, CPU, heads_major)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    tables, lens = [[3, 5], [7], [0, 1, 2, 9], [4, 6, 8, 10]], [7, 1, 13, 16]
    seqs = [SeqChunk(i, t, n - 1, (1,), GREEDY, is_decode=True) for i, (t, n) in enumerate(zip(tables, lens))]
    layout = BatchLayout.build(MicroBatch(0, tuple(seqs)), CPU, 4)
    q = torch.randn(4, heads, head_dim, generator=g).to(dtype)
    got = paged_decode(q, cache.k[0], cache.v[0], layout.decode_tables, layout.decode_seqlens,
                       window, block_n=4, sms=sms)  # 64 "multiprocessors": 2 to 4 splits
    want = decode_attention_views(q.float(), cache.k[0].float(), cache.v[0].float(), layout, window)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)


def test_paged_decode_without_triton_is_a_one_line_error():
    from pp_runtime.core.errors import ConfigError
    from pp_runtime.model.paged_kernel import triton_available, use_paged_decode

    if triton_available():
        pytest.skip("Triton runs here")
    cfg = load_config("tiny").with_overrides(decode_attention="paged")
    with pytest.raises(ConfigError, match="runtime.decode_attention: paged needs Triton"):
        use_paged_decode(cfg, CPU)
    assert not use_paged_decode(cfg.with_overrides(decode_attention="auto"), CPU)
