"""Building a stage: the dtype it gets, that it is built on the meta device and allocated
once in its final dtype, that a checkpoint is copied straight into place, and that random
init draws only this rank's shard yet gives the same full tensors at any tp."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from pp_runtime.config import Config, ConfigError, ModelConfig, load_model_config
from pp_runtime.engine.llm import LLM
from pp_runtime.costmodel.memory import stage_memory, stage_params
from pp_runtime.model.loader import checkpoint_dtype, model_config_from_hf, read_hf_config
from pp_runtime.model.transformer import StageModel, materialize
from pp_runtime.parallel.layers import LocalShard, Unsharded, shard_of
from pp_runtime.model.cpu_kernels import PackedLinear, can_prepack, weight_bytes
from pp_runtime.worker.stage import StageWorker

CPU = torch.device("cpu")


# ---- the dtype rule ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype,saved,device,expected", [
    ("auto", "bfloat16", "cuda", "bfloat16"),  # the checkpoint's dtype on a GPU
    ("auto", "float16", "cuda", "float16"),
    ("auto", "float32", "cuda", "bfloat16"),  # an fp32 checkpoint is served in bf16 on a GPU
    ("auto", None, "cuda", "bfloat16"),  # unknown (or random weights)
    ("auto", "bfloat16", "cpu", "float32"),  # a CPU computes in fp32 (bf16 is ~8x slower)
    ("float16", "bfloat16", "cuda", "float16"),  # an explicit dtype always wins
    ("bfloat16", None, "cpu", "bfloat16"),
    ("float32", "bfloat16", "cuda", "float32"),
])
def test_dtype_rule(dtype, saved, device, expected):
    assert ModelConfig(dtype=dtype, checkpoint_dtype=saved).dtype_for(device) == expected


def test_auto_prices_the_gpu_dtype_and_bad_names_are_refused():
    assert ModelConfig(dtype="auto", checkpoint_dtype="float32").dtype_bytes == 2
    assert ModelConfig().dtype == "float32"  # hand-written configs keep their meaning
    with pytest.raises(ConfigError, match="model.checkpoint_dtype"):
        Config().with_overrides(checkpoint_dtype="float64")


@pytest.mark.parametrize("hf,expected", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),  # transformers < 5
    ({"dtype": "float16"}, "float16"),  # transformers >= 5
    ({"torch_dtype": "torch.float16"}, "float16"),
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, "bfloat16"),
    ({"torch_dtype": "auto"}, None), ({"torch_dtype": "float64"}, None), ({}, None),
])
def test_checkpoint_dtype_is_read_from_either_key(hf, expected):
    assert checkpoint_dtype(hf) == expected


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A GPT-2 saved in bfloat16 by transformers."""
    from conftest import hf_model

    model = hf_model("gpt").to(torch.bfloat16)
    path = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(path)
    return model, path


def test_a_bf16_checkpoint_is_bf16_on_a_gpu_and_fp32_on_this_cpu(bf16_checkpoint):
    model, path = bf16_checkpoint
    assert checkpoint_dtype(read_hf_config(path)) == "bfloat16"
    m = model_config_from_hf(read_hf_config(path))
    assert (m.dtype, m.dtype_for("cuda"), m.dtype_for("cpu")) == ("auto", "bfloat16", "float32")
    with LLM.from_pretrained(path, executor="local", device="cpu") as llm:
        worker = llm.executor.workers[0]
        assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
        assert worker.cache.k[0].dtype == torch.float32
        wte = model.transformer.wte.weight
        assert torch.equal(worker.model.embed.weight, wte.float())  # bf16 values, exactly
    with LLM.from_pretrained(path, executor="local", device="cpu", dtype="bfloat16") as llm:
        worker = llm.executor.workers[0]  # what a GPU gets, here by the explicit override
        assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
        assert worker.cache.k[0].dtype == torch.bfloat16
        assert torch.equal(worker.model.embed.weight, wte)
        out = llm.generate([[1, 2, 3]])[0]
        assert len(out.token_ids) > 0


# ---- built on meta, allocated once ------------------------------------------------------
def test_materialize_keeps_ties_shards_and_allocates_in_the_final_dtype():
    m = load_model_config("tiny-gpt")
    with torch.device("meta"):
        model = StageModel(m, 0, m.num_layers, LocalShard(2, 1))
    assert all(p.is_meta for p in model.parameters())
    shards = {n: shard_of(p) for n, p in model.named_parameters()}
    materialize(model, CPU, torch.bfloat16)
    assert model.lm_head.weight is model.embed.weight  # tied: one tensor
    assert all(p.device == CPU and p.dtype == torch.bfloat16 for p in model.parameters())
    assert {n: shard_of(p) for n, p in model.named_parameters()} == shards
    assert sum(p.numel() for p in model.parameters()) == stage_params(m, 2, 0, m.num_layers)


def _peak_bytes(fn, mapped_sizes: set[int] = frozenset()):
    """The most bytes the CPU allocator held at once while `fn` ran (above the start), and
    fn's result. `mapped_sizes`: the sizes of checkpoint files, whose memory maps the
    reader opens (page cache, not copies) and which are left out."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and abs(e.nbytes()) not in mapped_sizes)
    held = peak = 0
    for _, n in events:
        held += n
        peak = max(peak, held)
    return peak, out


@pytest.fixture(scope="module")
def gpt2_small_checkpoint(tmp_path_factory):
    """GPT-2-small widths (768 wide, 50257 tokens), 2 layers, saved in float32."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2-small")
    GPT2LMHeadModel(GPT2Config(n_layer=2)).save_pretrained(path)
    return path


@pytest.mark.parametrize("prepack", [False, True], ids=["dense", "prepacked"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_building_a_stage_from_a_checkpoint_allocates_one_copy(gpt2_small_checkpoint, dtype,
                                                               prepack):
    """Stage 0 of 2 (the embedding and one layer, 186 MB in fp32): the worker allocates its
    weights once, in their final dtype, and copies the file's tensors straight into them.
    Built in fp32 and cast (the old way) it held 1.5x the fp32 size at bf16. Packing the
    linear layers for oneDNN frees each dense weight as its packed copy is made; where this
    CPU cannot run oneDNN in the dtype (bf16 wants AVX-512 bf16), the stage stays dense."""
    path = gpt2_small_checkpoint
    packs = prepack and can_prepack(getattr(torch, dtype))  # what this machine reports
    cfg = Config(model=model_config_from_hf(read_hf_config(path))).with_overrides(
        pp=2, dtype=dtype, max_batch_size=1, max_seq_len=16, prepack=prepack)
    files = {f.stat().st_size for f in path.glob("*.safetensors")}
    peak, worker = _peak_bytes(lambda: StageWorker(cfg, 0, CPU, path), files)
    assert any(isinstance(m, PackedLinear) for m in worker.model.modules()) == packs
    weights = weight_bytes(worker.model)
    fp32 = stage_params(cfg.model, 1, 0, 1) * 4
    assert weights == stage_memory(cfg, 0, 4 if dtype == "float32" else 2).weight_bytes
    print(f"\n{dtype}: peak {peak / 1e6:.1f} MB for {weights / 1e6:.1f} MB of weights + "
          f"{worker.cache.nbytes / 1e6:.2f} MB of KV (fp32 size {fp32 / 1e6:.1f} MB)")
    # nothing but the weights and KV (packing: plus the one layer being packed)
    packing = max((m.weight.numel() * m.weight.element_size() for m in worker.model.modules()
                   if isinstance(m, PackedLinear)), default=0)
    assert peak <= weights + worker.cache.nbytes + packing + 2**20
    assert peak < 2 * fp32


def test_random_init_allocates_one_copy_and_a_bounded_staging_buffer():
    cfg = Config().with_overrides(vocab_size=4096, num_layers=2, dtype="bfloat16",
                                  max_batch_size=1, max_seq_len=16)
    peak, worker = _peak_bytes(lambda: StageWorker(cfg, 0, CPU))
    weights = weight_bytes(worker.model)
    print(f"\nrandom bf16: peak {peak / 1e6:.1f} MB for {weights / 1e6:.1f} MB of weights")
    assert peak <= weights + worker.cache.nbytes + 3 * 4 * 2**20  # + float32 staging, 4 MB


# ---- random init by shard ---------------------------------------------------------------
def _random(m: ModelConfig, par, lo: int = 0, hi: int | None = None) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = StageModel(m, lo, m.num_layers if hi is None else hi, par)
    materialize(model, CPU, torch.float32)
    model.init_random(3)
    return dict(model.named_parameters())


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_each_rank_draws_exactly_its_slice_of_the_unsharded_tensors(name):
    m = replace(load_model_config(name), vocab_size=509)  # odd: padded at tp 2 and 4
    whole = _random(m, Unsharded())
    for tp in (2, 4) if m.kv_heads % 4 == 0 else (2,):
        for rank in range(tp):
            for n, p in _random(m, LocalShard(tp, rank)).items():
                assert torch.equal(shard_of(p).take(whole[n]), p), (tp, rank, n)
    # and any cut into stages: stage 1 of 2 holds layers 2, 3 of the whole model
    last = _random(m, Unsharded(), lo=2)
    assert torch.equal(last["layers.0.fc1.weight"], whole["layers.2.fc1.weight"])
    head = "embed.weight" if m.tied else "lm_head.weight"  # a tied head is the embedding
    assert torch.equal(last["lm_head.weight"], whole[head])
    std = whole["layers.1.qkv.weight"].std().item()
    assert 0.018 < std < 0.022 and whole["layers.1.qkv.bias" if m.family == "gpt"
                                         else "layers.1.attn_norm.weight"].unique().numel() == 1


def test_a_rank_draws_only_its_share(monkeypatch):
    """GPT-2 widths: at tp = 2 each rank draws half of every cut tensor (the replicated
    position embedding whole), where drawing each full tensor would cost tp times more."""
    m = Config().model
    real, drawn = torch.randn, []

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        drawn.append(out.numel())
        return out

    monkeypatch.setattr(torch, "randn", counting)
    cost = {}
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        drawn.clear()
        _random(m, LocalShard(tp, rank) if tp > 1 else Unsharded(), hi=2)
        cost[(tp, rank)] = sum(drawn)
    pos = m.max_positions * m.hidden_size  # replicated: every rank draws it whole
    for rank in (0, 1):
        assert cost[(2, rank)] - pos == pytest.approx((cost[(1, 0)] - pos) / 2, rel=1e-3)


def test_megatron_layers_build_on_meta_and_materialize():
    """Megatron-core's parallel layers allocate in their constructors: under
    torch.device("meta") (use_cpu_initialization, no init) they allocate nothing, and
    `materialize` keeps their attributes. A one-rank group runs them here."""
    pytest.importorskip("megatron.core")
    from pp_runtime.parallel.layers import TensorParallel

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = load_model_config("tiny-llama")
        with torch.device("meta"):
            model = StageModel(m, 0, m.num_layers, TensorParallel(dist.group.WORLD, 1, 0,
                                                                  torch.bfloat16))
        assert all(p.is_meta for p in model.parameters())
        attrs = model.layers[0].qkv.weight.__dict__.keys()
        assert "partition_dim" in attrs or "tensor_model_parallel" in attrs or "allreduce" in attrs
        materialize(model, CPU, torch.float32)
        assert model.layers[0].qkv.weight.__dict__.keys() == attrs
        model.init_random(3)
        plain = _random(m, Unsharded())
        for n, p in model.named_parameters():
            assert torch.equal(p, plain[n]), n
        ids = torch.arange(5)
        assert torch.equal(model.embed(ids), plain["embed.weight"][ids])
    finally:
        dist.destroy_process_group()


def test_random_init_is_deterministic_and_differs_between_tensors():
    m = load_model_config("tiny-gpt")
    a, b = _random(m, Unsharded()), _random(m, Unsharded())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.fc1.weight"], a["layers.1.fc1.weight"])
