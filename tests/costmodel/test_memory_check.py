"""Memory checked before allocation: a stage's weights and KV against what the device
offers, with the largest batch that fits in the error; the worker checks the device's free
memory before it allocates, the simulator the simulated GPU's capacity before it runs."""
from __future__ import annotations

import pytest
import torch

from pp_runtime.costmodel import memory
from pp_runtime.worker import stage as worker_module
from pp_runtime.config import Config, ConfigError, load_config
from pp_runtime.costmodel.memory import check_fits, free_bytes, smallest_deployment, stage_memory
from pp_runtime.engine.simulate import check_memory, simulate
from pp_runtime.model.cpu_kernels import can_prepack, weight_bytes
from pp_runtime.worker.stage import StageWorker

CPU = torch.device("cpu")


def tiny(**overrides) -> Config:
    return load_config("tiny", **overrides)


@pytest.mark.parametrize("prepack", [False, True], ids=["dense", "prepacked"])
@pytest.mark.parametrize("pp, split", [(1, None), (2, None), (2, [3, 1]), (3, [1, 1, 2])])
def test_stage_memory_is_what_the_worker_allocates(pp, split, prepack):
    """Even and explicit layer splits: the check and the worker cut the model alike. On a
    CPU with prepacked layers, a stage holding both the tied embedding and the LM head has
    one more copy of it (docs/performance.md), which the check leaves out."""
    cfg = tiny(pp=pp, max_batch_size=3, layer_split=split, prepack=prepack)
    layers = []
    for stage in range(pp):
        worker = StageWorker(cfg, stage, CPU)
        layers.append(len(worker.model.layers))
        need = stage_memory(cfg, stage, 4)
        model = worker.model
        packed = prepack and can_prepack(torch.float32)  # oneDNN on this CPU
        tied_copy = (model.embed.weight.numel() * 4
                     if packed and model.is_first and model.is_last and cfg.model.tied else 0)
        assert (weight_bytes(model), worker.cache.nbytes) == (need.weight_bytes + tied_copy,
                                                              need.kv_bytes)
        assert need.slots == 3 * pp
    assert layers == (split or [4 // pp + (s < 4 % pp) for s in range(pp)])


@pytest.mark.parametrize("pp", [1, 2])
def test_the_error_names_the_largest_batch_that_fits(pp):
    cfg = tiny(pp=pp, max_batch_size=8)
    need = stage_memory(cfg, 0, 4)  # stage 0 holds the embedding: the largest
    usable = need.weight_bytes + 7.5 * need.kv_bytes_per_slot  # 7 slots fit
    best = 7 // pp  # per micro-batch, pp micro-batches in flight
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, usable, 4, "a small device")
    msg = str(err.value)
    assert msg.startswith("planner.max_batch_size: stage 0 needs ")
    assert f"max_batch_size={best} (kv_slots={best * pp})" in msg
    assert f"--set max_batch_size={best}" in msg and "a small device offers" in msg
    assert "--set max_seq_len=" in msg
    check_fits(cfg.with_overrides(max_batch_size=best), usable, 4, "a small device")  # fits


def test_explicit_kv_slots_get_a_kv_slots_fix():
    cfg = tiny(kv_slots=20)
    need = stage_memory(cfg, 0, 4)
    with pytest.raises(ConfigError, match=r"^cache.kv_slots: .*--set kv_slots=5"):
        check_fits(cfg, need.weight_bytes + 5.5 * need.kv_bytes_per_slot, 4, "a small device")


def test_weights_that_do_not_fit_point_at_more_devices():
    cfg = tiny(max_batch_size=2)
    need = stage_memory(cfg, 0, 4)
    with pytest.raises(ConfigError, match=r"^parallel.tp, parallel.pp: .*weights alone do not "
                                          r"fit.*--set tp=\d+ --set pp=\d+"):
        check_fits(cfg, need.weight_bytes * 0.6, 4, "a small device")


def test_the_worker_refuses_before_allocating(monkeypatch):
    cfg = tiny(max_batch_size=8)
    need = stage_memory(cfg, 0, 4)
    free = (need.weight_bytes + 4.5 * need.kv_bytes_per_slot) / cfg.cache.memory_utilization
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(free))
    allocated, real = [], worker_module.materialize
    monkeypatch.setattr(worker_module, "materialize", lambda *a: allocated.append(a) or real(*a))
    with pytest.raises(ConfigError, match=r"stage 0 \(tp rank 0\) needs .* but cpu \(.* GB free "
                                          r"x cache.memory_utilization 0.9\) offers .*"
                                          r"max_batch_size=4 \(kv_slots=4\)"):
        StageWorker(cfg, 0, CPU)
    assert allocated == []  # nothing was allocated
    StageWorker(cfg.with_overrides(max_batch_size=4), 0, CPU)  # and B = 4 builds
    assert len(allocated) == 1


def test_free_bytes_of_this_cpu():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < free_bytes(CPU) <= total


# ---- the simulator ------------------------------------------------------------------------
def test_simulator_refuses_gpt3_on_one_a100():
    cfg = load_config("paper/gpt3_tp8_pp8", tp=1, pp=1)
    with pytest.raises(ConfigError, match=r"^parallel.tp, parallel.pp: stage 0 needs .* one "
                                          r"a100-80gb \(80 GB x cache.memory_utilization 0.9\).*"
                                          r"weights alone do not fit.*--set tp=8 --set pp=8"):
        simulate(cfg, progress=False)
    assert smallest_deployment(cfg, 72e9, 2) == (8, 8)  # B = 27 needs the paper's 64 GPUs


def test_simulator_names_the_paper_b_when_the_batch_is_too_big():
    with pytest.raises(ConfigError, match=r"max_batch_size=27 \(kv_slots=216\)"):
        check_memory(load_config("paper/gpt3_tp8_pp8", max_batch_size=28))
    with pytest.raises(ConfigError, match=r"max_batch_size=11 \(kv_slots=11\)"):
        check_memory(load_config("paper/gpt3_tp8", max_batch_size=12))


@pytest.mark.parametrize("name", ["default", "tiny", "cpu/gpt2_pp2", "cpu/gpt2_tp2_pp2", "cpu/llama_pp2",
                                  "paper/gpt3_tp8", "paper/gpt3_tp8_pp8"])
def test_every_shipped_deployment_fits(name):
    check_memory(load_config(name))


@pytest.mark.parametrize("kv_heads", [None, 4], ids=["mha", "gqa"])
def test_one_kv_size_rule_for_the_plan_the_stages_and_run(kv_heads):
    """K and V counted once (`memory.kv_bytes_per_token`): the paper's B (`memory_plan`),
    each stage's blocks (`stage_memory`) and `run`'s line (`kv_cache_bytes`) agree with a
    hand count. GPT-2-small shapes, fp16, tp=2 x pp=2, 64 blocks of 16 tokens: a token is
    2 (K, V) x 12 layers x 12 (or 4 GQA) heads x 64 dims x 2 bytes."""
    import dataclasses

    from pp_runtime.cli.run import kv_cache_text
    from pp_runtime.costmodel.memory import kv_cache_bytes, memory_plan

    cfg = Config().with_overrides(tp=2, pp=2, dtype="float16", paged=True, num_blocks=64,
                                  block_size=16)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_kv_heads=kv_heads))
    heads = kv_heads or 12
    token = 2 * 12 * heads * 64 * 2  # every layer and head: 36864 B (GQA 12288 B)
    assert kv_cache_bytes(cfg) == 64 * 16 * token
    assert f"= {64 * 16 * token / 2**20:.0f} MiB" in kv_cache_text(cfg)
    assert memory_plan(cfg, 80).kv_bytes_per_token == token // 4  # 6 layers, 1/2 the heads
    stages = [stage_memory(cfg, s, 2) for s in range(2)]
    assert [s.kv_bytes_per_block for s in stages] == [16 * token // 4] * 2
    # x tp ranks; a stage also allocates one scratch block past the pool (KVCache.scratch_block)
    assert sum((s.kv_bytes - s.kv_bytes_per_block) * 2 for s in stages) == kv_cache_bytes(cfg)
