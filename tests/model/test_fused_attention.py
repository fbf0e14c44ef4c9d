"""Attention runs on fused kernels, and still equals `transformers`.

Inside `sdpa_kernel(SDPBackend.FLASH_ATTENTION)` an SDPA call that the flash kernel cannot
take raises instead of falling back to the math kernel. PyTorch has a flash kernel for the
CPU too, so these CPU tests prove that chunked prefill (first and later chunks) and hybrid
batches (a chunk + decodes) never touch the math kernel, for GPT-2 and for LLaMA with GQA.
The CUDA tests at the end run where a GPU is present.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import slot_tables
from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
from pp_runtime.config import Config
from pp_runtime.model import attention
from pp_runtime.model.attention import attention_paths
from pp_runtime.model.loader import model_config_from_hf, read_hf_config
from pp_runtime.worker.stage import StageWorker

GREEDY = Sampling(0.0, 1.0, 0)
LAYERS = 3  # of the conftest checkpoints
FLASH_ONLY = SDPBackend.FLASH_ATTENTION


def make_worker(path, device="cpu", dtype="float32", **runtime) -> StageWorker:
    cfg = Config(model=model_config_from_hf(read_hf_config(path))).with_overrides(
        kv_slots=8, dtype=dtype, **runtime)
    return StageWorker(cfg, 0, torch.device(device), checkpoint=path)


def run(worker: StageWorker, seqs) -> torch.Tensor:
    hidden, _ = worker.forward(MicroBatch(0, slot_tables(seqs, worker.cfg)), None)
    return worker.model.logits(hidden).cpu()  # [num_tokens, vocab] float32


def hf_logits(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]  # [len(prompt), vocab]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (45, 30, 21, 12)]


def calls_since(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in attention_paths().items() if v != before[k]}


def hybrid_run(worker: StageWorker, p: list[list[int]]) -> tuple[torch.Tensor, dict[str, int]]:
    """Prompts 1-3 prefilled but for their last token, the chunk [0, 16) of prompt 0; then one
    micro-batch: the 3 decodes (KV of 30, 21, 12 keys) and the chunk [16, 40) of prompt 0.
    Returns the logits of the first chunk and of the micro-batch [16 + 3 + 24, vocab], and the
    attention calls of the micro-batch."""
    for slot in (1, 2, 3):
        run(worker, [SeqChunk(slot, slot, 0, tuple(p[slot][:-1]), None)])
    first = run(worker, [SeqChunk(0, 0, 0, tuple(p[0][:16]), None)])
    decodes = [SeqChunk(s, s, len(p[s]) - 1, (p[s][-1],), GREEDY, is_decode=True)
               for s in (1, 2, 3)]
    before = attention_paths()
    mixed = run(worker, decodes + [SeqChunk(0, 0, 16, tuple(p[0][16:40]), None)])
    return torch.cat([first, mixed]), calls_since(before)


@pytest.mark.filterwarnings("ignore:.*kernel not used:UserWarning")
@pytest.mark.filterwarnings("ignore:All fused kernels:UserWarning")
def test_the_old_3d_call_cannot_run_on_the_flash_kernel():
    """What attention.py did before (3-D tensors; a dense mask for a later chunk) raises
    under the flash-only context, so the tests below would catch a math-kernel fallback;
    the same data as 4-D views with the lower-right bias runs there and gives the same
    result."""
    g = torch.Generator().manual_seed(0)
    start, n, heads, kv_heads, d = 9, 5, 8, 2, 8
    q = torch.randn(heads, n, d, generator=g)  # [heads, n, head_dim]
    k, v = (torch.randn(kv_heads, start + n, d, generator=g) for _ in range(2))
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    old = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with sdpa_kernel(FLASH_ONLY):
        with pytest.raises(RuntimeError, match="No available kernel"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        with pytest.raises(RuntimeError, match="No available kernel"):
            F.scaled_dot_product_attention(q, k[:, :n], v[:, :n], is_causal=True, enable_gqa=True)
        k_cache = k.transpose(0, 1)[None]  # [1 block of start + n, kv_heads, head_dim]
        v_cache = v.transpose(0, 1)[None]
        span = attention.PrefillSpan(slice(0, n), torch.tensor([0]), start)
        new = attention.prefill_attention(q.transpose(0, 1), k_cache, v_cache, span)
    torch.testing.assert_close(new.transpose(0, 1), old)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_on_flash_equals_transformers(hf_checkpoint, chunk):
    """A 45-token prompt in chunks of 1, 7 or 16 (none divides 45): the first chunk is plain
    causal, every later one lower-right causal over the cached KV, all on the flash kernel."""
    family, model, path = hf_checkpoint
    prompt = prompts(model.config.vocab_size)[0]
    worker = make_worker(path)
    before = attention_paths()
    with sdpa_kernel(FLASH_ONLY):
        ours = torch.cat([run(worker, [SeqChunk(0, 0, s, tuple(prompt[s:s + chunk]), None)])
                          for s in range(0, len(prompt), chunk)])
    torch.testing.assert_close(ours, hf_logits(model, prompt), atol=5e-5, rtol=1e-4)
    later_chunks = math.ceil(len(prompt) / chunk) - 1
    assert calls_since(before) == {"prefill_causal": LAYERS,
                                   "prefill_lower_right": LAYERS * later_chunks}


@pytest.mark.parametrize("kernel", [True, False], ids=["decode_cpu", "decode_views"])
def test_hybrid_batch_on_flash_equals_transformers(hf_checkpoint, kernel):
    """A micro-batch of 3 decodes and a later chunk of another prompt: every row equals the
    logits transformers gives its own prompt, with the decodes in one C++ call per layer or
    one SDPA call each."""
    family, model, path = hf_checkpoint
    p = prompts(model.config.vocab_size)
    with sdpa_kernel(FLASH_ONLY):
        logits, calls = hybrid_run(make_worker(path, cpu_decode_kernel=kernel), p)
    decodes = {"decode_cpu": LAYERS} if kernel else {"decode_views": 3 * LAYERS}
    assert calls == {"prefill_lower_right": LAYERS, **decodes}
    mixed = logits[16:]
    for i, s in enumerate((1, 2, 3)):
        torch.testing.assert_close(mixed[i], hf_logits(model, p[s])[-1], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(logits[:16], hf_logits(model, p[0])[:16], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(mixed[3:], hf_logits(model, p[0])[16:40], atol=5e-5, rtol=1e-4)


def reference_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k):
    """FlashAttention-2's varlen forward as its contract reads, in plain torch: sequence b has
    query rows [cu_q[b], cu_q[b + 1]) and the seqused_k[b] key rows from cu_k[b] on; the
    sequences lie in order and never overlap. q: [total_q, heads, head_dim]."""
    assert cu_q.dtype == cu_k.dtype == seqused_k.dtype == torch.int32
    assert (cu_k[:-1] + seqused_k <= cu_k[1:]).all() and int(cu_k[-1]) <= k.shape[0]
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int(seqused_k.max())
    out = torch.empty_like(q)
    for b in range(len(seqused_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b]) + int(seqused_k[b]))
        group = q.shape[1] // k.shape[1]
        kb, vb = (t[keys].repeat_interleave(group, 1) for t in (k, v))  # [n, heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q[rows], kb) / math.sqrt(q.shape[-1])
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb)
    return out


def test_varlen_decode_call_equals_views(hf_checkpoint, monkeypatch):
    """The CUDA decode path hands the varlen kernel the right offsets and lengths: with a
    reference implementation of its contract in its place, decodes in slots out of order
    (and a chunk) give the logits of the per-decode views path."""
    family, model, path = hf_checkpoint
    p = prompts(model.config.vocab_size)
    worker = make_worker(path, kv_layout="tokens",  # the order the varlen kernel reads
                         cpu_decode_kernel=False)
    slot_of = {1: 6, 2: 1, 3: 4}  # request -> slot: the batch lists the slots as 6, 1, 4
    for s, slot in slot_of.items():
        run(worker, [SeqChunk(s, slot, 0, tuple(p[s][:-1]), None)])
    seqs = [SeqChunk(s, slot, len(p[s]) - 1, (p[s][-1],), GREEDY, is_decode=True)
            for s, slot in slot_of.items()] + [SeqChunk(0, 5, 0, tuple(p[0][:9]), None)]
    views = run(worker, seqs)
    monkeypatch.setattr(attention, "flash_varlen", reference_flash_varlen)
    monkeypatch.setattr(attention, "decode_kernel", lambda q, k_cache, layout: "varlen")
    before = attention_paths()
    varlen = run(worker, seqs)
    assert calls_since(before) == {"prefill_causal": LAYERS, "decode_varlen": LAYERS}
    torch.testing.assert_close(varlen, views, atol=2e-5, rtol=1e-5)


def test_attention_reads_only_the_keys_it_attends_to(hf_checkpoint):
    """A cache full of NaN, then a chunked prefill and decodes: any read past a sequence's
    own written keys (padding, another slot) would turn its logits into NaN."""
    family, model, path = hf_checkpoint
    p = prompts(model.config.vocab_size)
    worker = make_worker(path)
    for t in (*worker.cache.k, *worker.cache.v):
        t.fill_(float("nan"))
    with sdpa_kernel(FLASH_ONLY):
        run(worker, [SeqChunk(1, 1, 0, tuple(p[1][:-1]), None)])
        run(worker, [SeqChunk(2, 2, 0, tuple(p[2][:-1]), None)])
        out = run(worker, [SeqChunk(1, 1, len(p[1]) - 1, (p[1][-1],), GREEDY, is_decode=True),
                           SeqChunk(2, 2, len(p[2]) - 1, (p[2][-1],), GREEDY, is_decode=True),
                           SeqChunk(0, 0, 0, tuple(p[0][:7]), None)])
        out = torch.cat([out, run(worker, [SeqChunk(0, 0, 7, tuple(p[0][7:20]), None)])])
    assert torch.isfinite(out).all()


# ---- CUDA: run where a GPU is present -------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("decodes", ["paged", "gather"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_hybrid_batch_runs_on_flash(hf_checkpoint, dtype, decodes, monkeypatch):
    """On CUDA in half precision the chunks run inside the flash-only context and the decodes
    in one call per layer (the paged Triton kernel, or the gather path's varlen flash);
    against the float32 CPU run they are as accurate as the unfused kernels in the same
    dtype (math backend, one call per decode): half precision's rounding, no more (a wrong
    mask or slot would be far off)."""
    if decodes == "paged":
        pytest.importorskip("triton")
    family, model, path = hf_checkpoint
    p = prompts(model.config.vocab_size)
    ref, _ = hybrid_run(make_worker(path), p)  # float32 on the CPU
    with sdpa_kernel(FLASH_ONLY):
        fused, calls = hybrid_run(make_worker(path, "cuda", dtype, decode_attention=decodes), p)
    kernel = "decode_paged" if decodes == "paged" else "decode_varlen"
    assert calls == {"prefill_lower_right": LAYERS, kernel: LAYERS}
    monkeypatch.setattr(attention, "decode_kernel", lambda q, k_cache, layout: "views")
    with sdpa_kernel(SDPBackend.MATH):
        unfused, _ = hybrid_run(make_worker(path, "cuda", dtype), p)
    error = lambda x: float((x - ref).abs().max() / ref.abs().max())  # noqa: E731
    assert error(fused) <= 2 * error(unfused) + 1e-3, (error(fused), error(unfused))


@cuda
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cuda_dense_mask_is_refused_by_flash_but_lower_right_is_not():
    """On CUDA the flash kernel takes no dense mask (the old later-chunk call fell to another
    kernel); the lower-right bias keeps it on flash."""
    from torch.nn.attention.bias import causal_lower_right

    start, n, heads, kv_heads, d = 40, 24, 8, 2, 64
    q = torch.randn(1, heads, n, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, kv_heads, start + n, d, device="cuda", dtype=torch.float16)
            for _ in range(2))
    mask = torch.arange(start + n, device="cuda")[None, :] <= torch.arange(
        start, start + n, device="cuda")[:, None]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                         enable_gqa=True)
    with sdpa_kernel(FLASH_ONLY):
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, start + n),
                                             enable_gqa=True)
    torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)


@cuda
@pytest.mark.parametrize("kv_heads, window", [(8, None), (2, None), (2, 100)])
def test_cuda_varlen_decode_equals_per_decode_views(kv_heads, window):
    """The real varlen kernel against one SDPA call per decode, on a cache of 1024 blocks
    of 16 with decodes whose tables are scattered over it (lengths 1 to 1000), with and
    without GQA, and with a sliding window of 100 (each decode's last 100 keys)."""
    from pp_runtime.model.attention import BatchLayout, decode_attention, decode_attention_views

    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = (torch.randn(1024, 16, kv_heads, 64, generator=g, device="cuda",
                                    dtype=torch.float16) for _ in range(2))
    lens = [1000, 1, 17, 512, 256, 999, 64]
    order = torch.randperm(1024, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [order[64 * i:64 * (i + 1)] for i in range(7)]
    mb = MicroBatch(0, tuple(SeqChunk(i, t, n - 1, (0,), None, is_decode=True)
                             for i, (t, n) in enumerate(zip(tables, lens))))
    layout = BatchLayout.build(mb, torch.device("cuda"), 16)
    q = torch.randn(7, 8, 64, generator=g, device="cuda", dtype=torch.float16)
    before = attention_paths()
    got = decode_attention(q, k_cache, v_cache, layout, window)
    assert calls_since(before) == {"decode_varlen": 1}
    want = decode_attention_views(q, k_cache, v_cache, layout, window)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("start, n, kv_heads", [(1, 1, 2), (40, 24, 2), (7, 30, 8)])
def test_the_cpu_lower_right_mask_is_torchs_bias_to_the_bit(start, n, kv_heads):
    """On CPU a later chunk's mask is built here, not by torch's `causal_lower_right`
    (whose import costs a worker a second of torch._dynamo): the same outputs, bit for bit,
    and a stage worker's imports and build leave torch._dynamo out."""
    import subprocess
    import sys

    from torch.nn.attention.bias import causal_lower_right

    torch.manual_seed(start + n)
    heads, d = 8, 16
    q = torch.randn(1, heads, n, d)
    k, v = (torch.randn(1, kv_heads, start + n, d) for _ in range(2))
    ours = attention.lower_right(n, start + n, q.device)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.bool
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=ours, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, start + n),
                                         enable_gqa=True)
    assert torch.equal(got, ref)
    if start == 1:
        code = ("import sys, pp_runtime.worker.stage, pp_runtime.executors.ray_actor; "
                "from pp_runtime import LLM; "  # a worker built too (model/transformer.ShapesOnly)
                "LLM('tiny', executor='local', threads_per_worker=1); "
                "print('torch._dynamo' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.split()
        assert out == ["False"], out
