"""The CPU fast paths (model/cpu_kernels.py) against plain torch: the decode-attention C++
kernel against one SDPA call per decode, and prepacked linear layers against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
from pp_runtime.model.attention import BatchLayout, attention_paths, decode_attention, decode_attention_views
from pp_runtime.model.cpu_kernels import PackedLinear, decode_extension, prepack_linears
from pp_runtime.model.kv_cache import KVCache

needs_kernel = pytest.mark.skipif(decode_extension() is None, reason="no C++ compiler here")


def decode_batch(tables_lens: list[tuple[list[int], int]]) -> MicroBatch:
    """Decodes in the order given: (block table, kv_len) each."""
    greedy = Sampling(0.0, 1.0, 0)
    return MicroBatch(0, tuple(SeqChunk(i, table, n - 1, (0,), greedy, is_decode=True)
                               for i, (table, n) in enumerate(tables_lens)))


def dense_reference(q, k_cache, v_cache, tables_lens, window: int | None = None) -> torch.Tensor:
    """Each decode's keys copied out block by block in table order (its last `window` of
    them with a window), then one SDPA call: the block table's meaning written
    independently of the layout code."""
    out = []
    for i, (table, n) in enumerate(tables_lens):
        first = max(0, n - window) if window else 0
        k = torch.cat([k_cache[b] for b in table])[first:n].transpose(0, 1)[None].float()
        v = torch.cat([v_cache[b] for b in table])[first:n].transpose(0, 1)[None].float()
        out.append(F.scaled_dot_product_attention(q[i][None, :, None].float(), k, v,
                                                  enable_gqa=True)[0, :, 0])
    return torch.stack(out).to(q.dtype)


@needs_kernel
@pytest.mark.parametrize("heads_major", [True, False], ids=["heads", "tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_decode_kernel_equals_sdpa_per_decode(heads_major, dtype, kv_heads):
    """Block tables scattered over the pool and out of order, lengths from 1 to four whole
    blocks (and one ending mid-block), GQA and MQA, either cache order: the one call gives
    the outputs of SDPA over each decode's keys copied out by hand."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 24, 16, kv_heads, 32, dtype, torch.device("cpu"), heads_major)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    work = [([23, 4, 17, 9], 64), ([0], 1), ([5, 11], 17), ([8, 2, 20], 40)]
    layout = BatchLayout.build(decode_batch(work), torch.device("cpu"), 16, cpu_decode=True)
    q = torch.randn(4, 4, 32, generator=g).to(dtype)  # [D, heads, head_dim]
    before = attention_paths()["decode_cpu"]
    got = decode_attention(q, cache.k[0], cache.v[0], layout)
    assert attention_paths()["decode_cpu"] == before + 1
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, dense_reference(q, cache.k[0], cache.v[0], work), **tol)
    views = decode_attention_views(q, cache.k[0], cache.v[0], layout)  # the fallback path
    torch.testing.assert_close(views, dense_reference(q, cache.k[0], cache.v[0], work), **tol)


@needs_kernel
@pytest.mark.parametrize("heads_major", [True, False], ids=["heads", "tokens"])
@pytest.mark.parametrize("window", [1, 5, 16, 21])
def test_decode_kernel_with_a_sliding_window_reads_the_last_keys(heads_major, window):
    """A sliding window (Mistral): each decode attends to its last `window` keys, starting
    mid-block or on a block's edge, and those before the window are never read (NaN there
    stays out); shorter decodes read all of theirs. The views path agrees."""
    g = torch.Generator().manual_seed(1)
    cache = KVCache(1, 24, 16, 2, 32, torch.float32, torch.device("cpu"), heads_major)
    work = [([23, 4, 17, 9], 64), ([0], 1), ([5, 11], 17), ([8, 2, 20], 40)]
    for t in (cache.k[0], cache.v[0]):
        t.fill_(float("nan"))
        for table, n in work:
            for j in range(max(0, n - window), n):
                t[table[j // 16], j % 16] = torch.randn(2, 32, generator=g)
    layout = BatchLayout.build(decode_batch(work), torch.device("cpu"), 16, cpu_decode=True)
    q = torch.randn(4, 4, 32, generator=g)
    before = attention_paths()["decode_cpu"]
    got = decode_attention(q, cache.k[0], cache.v[0], layout, window)
    assert attention_paths()["decode_cpu"] == before + 1
    torch.testing.assert_close(got, dense_reference(q, cache.k[0], cache.v[0], work, window))
    torch.testing.assert_close(decode_attention_views(q, cache.k[0], cache.v[0], layout, window), got)


@needs_kernel
def test_decode_kernel_reads_only_each_decodes_keys():
    """NaN everywhere but the keys each decode attends to: a read past them shows."""
    cache = KVCache(1, 6, 4, 2, 8, torch.float32, torch.device("cpu"), True)
    k, v = cache.k[0], cache.v[0]
    k.fill_(float("nan"))
    v.fill_(float("nan"))
    work = [([5, 1], 5), ([0, 3, 2, 4], 16)]
    for table, n in work:
        for j in range(n):
            k[table[j // 4], j % 4] = torch.randn(2, 8)
            v[table[j // 4], j % 4] = torch.randn(2, 8)
    layout = BatchLayout.build(decode_batch(work), torch.device("cpu"), 4, cpu_decode=True)
    assert torch.isfinite(decode_attention(torch.randn(2, 2, 8), k, v, layout)).all()


@needs_kernel
def test_decode_kernel_refuses_bad_input():
    q, k = torch.randn(1, 2, 8), torch.zeros(2, 4, 2, 8)
    ext = decode_extension()
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.decode_attention(q, k, k, torch.tensor([[2]], dtype=torch.int32),
                             torch.tensor([1], dtype=torch.int32), 1.0, 0)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        ext.decode_attention(q, k, k, torch.tensor([[0]], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), 1.0, 0)
    with pytest.raises(RuntimeError, match="int32"):
        ext.decode_attention(q, k, k, torch.tensor([[0]]), torch.tensor([1]), 1.0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_equals_f_linear(dtype):
    """Every row count from 1 to 300 on one packing; packed layers drop the dense weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)).to(dtype)
    dense = [(m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in model]
    if prepack_linears(model) == 0:
        pytest.skip(f"oneDNN does not take {dtype} on this CPU")
    assert all(isinstance(m, PackedLinear) for m in model)
    assert not list(model.parameters())  # nothing dense kept
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 64).to(dtype)
        want = F.linear(F.linear(x, *dense[0]), *dense[1])
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(model(x), want, **tol)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's file lock, left behind by a build that was killed, used to make every later
    load wait for ever (Ray actors that never started): the next load goes through."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils import cpp_extension
    if decode_extension() is None:
        pytest.skip("no C++ toolchain here")
    name = decode_extension().__name__
    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    lock.write_text("")  # what a SIGKILLed build leaves
    code = "from pp_runtime.model.cpu_kernels import decode_extension as d; assert d() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # every load makes torch's `lock` for a moment (its baton, around ninja), and a load of
    # the suite's other worker may be under way: look while holding the flock our loads
    # take (`_build_lock`), so that none is (the file seen there once in a venv's suite)
    import fcntl
    with open(lock.parent / "pp_runtime.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        assert not lock.exists()


def test_the_same_source_at_another_path_loads_the_same_build(tmp_path):
    """The kernel compiles from a copy of its source in its build directory: the same
    source at another path (a wheel install beside a checkout) loads that build, where
    torch's ninja file naming the source's own path rebuilt it each time the two alternated
    (~30 s, under a lock every stage worker waits on)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils import cpp_extension

    from pp_runtime.model import cpu_kernels
    if decode_extension() is None:
        pytest.skip("no C++ toolchain here")
    name = decode_extension().__name__
    build = Path(cpp_extension._get_build_directory(name, verbose=False))
    (so,) = build.glob(f"{name}*.so")
    before = so.stat().st_mtime_ns
    assert str(cpu_kernels._SOURCE) not in (build / "build.ninja").read_text()
    other = tmp_path / "elsewhere" / cpu_kernels._SOURCE.name
    other.parent.mkdir()
    shutil.copyfile(cpu_kernels._SOURCE, other)
    code = ("from pathlib import Path; import pp_runtime.model.cpu_kernels as k; "
            f"k._SOURCE = Path({str(other)!r}); assert k.decode_extension() is not None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert so.stat().st_mtime_ns == before, "rebuilt for the same source at another path"
    assert str(other) not in (build / "build.ninja").read_text()
