"""The memory check and the simulator price the llama family's other checkpoints as the
worker builds them: every q/k/v bias, Qwen3's q/k norms and its heads wider than
hidden / heads are in each stage's weights, and the shipped LLaMA-3.1, Qwen2.5, Qwen3 and
Mistral shapes run through `simulate`."""
import pytest
import torch

from conftest import LLAMA_KIN, hf_model
from pp_runtime.config import Config, config_from_dict, load_model_config
from pp_runtime.costmodel.memory import kv_bytes_per_token, stage_params
from pp_runtime.engine.simulate import simulate
from pp_runtime.model.loader import model_config_from_hf
from pp_runtime.model.transformer import StageModel
from pp_runtime.parallel.layers import LocalShard


@pytest.mark.parametrize("family", sorted(LLAMA_KIN))
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_stage_params_are_what_a_rank_builds(family, tp, pp):
    m = model_config_from_hf(hf_model(family).config.to_dict())
    cfg = Config(model=m).with_overrides(tp=tp, pp=pp)
    for stage in range(pp):
        lo, hi = cfg.stage_layers(stage)
        with torch.device("meta"):
            model = StageModel(m, lo, hi, LocalShard(tp, tp - 1))
        assert sum(p.numel() for p in model.parameters()) == stage_params(m, tp, lo, hi)


def test_qwen3_prices_its_own_head_width():
    """Qwen3-32B: 64 heads of 128 on a 5120-wide model: q and o are 8192 wide, K and V
    8 x 128, and each layer has two 128-wide q/k norms."""
    m = load_model_config("qwen3-32b")
    h, q, kv, f = 5120, 64 * 128, 8 * 128, 25600
    assert m.head_dim == 128
    assert kv_bytes_per_token(m, 64, 1) == 2 * 64 * kv * 2  # K and V of 64 layers, bf16
    assert stage_params(m, 1, 1, 2) == h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h + 2 * 128


@pytest.mark.parametrize("name", ["llama3.1-8b", "llama3.1-70b", "qwen2.5-72b", "qwen3-32b",
                                  "mistral-7b"])
def test_the_simulator_prices_each_shipped_shape(name):
    cfg = config_from_dict({"model": name, "parallel": {"tp": 8, "pp": 2},
                            "cache": {"device_memory_gb": 80, "max_seq_len": 4096},
                            "hardware": {"gpu": "h100"},
                            "workload": {"num_requests": 20}})
    result = simulate(cfg, progress=False)
    assert len(result.requests) == 20
    assert all(r.finish_reason == "length" for r in result.requests)
