"""Config loading and validation: every bad case gets a ConfigError naming its field."""
import json

import pytest

from pp_runtime.config import (Config, ConfigError, ModelConfig, config_from_dict, load_config,
                               load_model_config)
from pp_runtime.costmodel.memory import memory_plan


@pytest.mark.parametrize("overrides, field", [
    (dict(num_heads=12, tp=5), "parallel.tp"),  # heads not divisible by tp
    (dict(family="llama", num_heads=8, num_kv_heads=2, tp=4, hidden_size=64), "parallel.tp"),
    (dict(num_layers=3, pp=4), "parallel.pp"),  # fewer layers than stages
    (dict(chunk_size=0), "planner.chunk_size"),
    (dict(chunk_size=4, max_batch_size=8), "planner.chunk_size"),  # no room for a prefill token
    (dict(max_batch_size=0), "planner.max_batch_size"),
    (dict(family="bert"), "model.family"),
    (dict(dtype="float8"), "model.dtype"),
    (dict(hidden_size=100, num_heads=12), "model.num_heads"),
    (dict(num_heads=12, num_kv_heads=5), "model.num_kv_heads"),
    (dict(planner="fifo"), "planner.planner"),
    (dict(kv_slots=0), "cache.kv_slots"),
    (dict(max_seq_len=4096), "cache.max_seq_len"),  # longer than max_positions
    (dict(memory_utilization=1.5), "cache.memory_utilization"),
    (dict(device="tpu"), "runtime.device"),
    (dict(eos_token_id=60000), "model.eos_token_id"),
    (dict(tp="2"), "parallel.tp"),  # wrong type
    (dict(pp=0), "parallel.pp"),
], ids=lambda x: str(x))
def test_bad_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Config().with_overrides(**overrides)


def test_unknown_override_lists_known_fields():
    with pytest.raises(ConfigError, match="unknown config field 'chunksize'.*chunk_size"):
        Config().with_overrides(chunksize=64)


def test_overrides_reach_every_section_and_keep_the_rest():
    cfg = Config().with_overrides(chunk_size=64, max_batch_size=4, pp=2, tp=1, planner="sarathi",
                                  num_layers=4, seed=3)
    assert (cfg.planner.chunk_size, cfg.planner.max_batch_size, cfg.parallel.pp) == (64, 4, 2)
    assert cfg.model.num_layers == 4 and cfg.runtime.seed == 3
    assert cfg.model.hidden_size == Config().model.hidden_size
    assert cfg.num_slots == 2 * 4  # pp x B slots by default


@pytest.mark.parametrize("name, layers, hidden, heads, billions", [
    ("gpt3-175b", 96, 12288, 96, 175), ("llama-13b", 40, 5120, 40, 13),
    ("llama-33b", 60, 6656, 52, 32.5), ("gpt2-small", 12, 768, 12, 0.124),
    # their model cards' counts: Qwen2.5's q/k/v biases and Qwen3's 128-wide heads and
    # q/k norms included
    ("llama3.1-8b", 32, 4096, 32, 8.03), ("llama3.1-70b", 80, 8192, 64, 70.55),
    ("qwen2.5-72b", 80, 8192, 64, 72.71), ("qwen3-32b", 64, 5120, 64, 32.76),
    ("mistral-7b", 32, 4096, 32, 7.24), ("llama-cpu-300m", 8, 1536, 12, 0.2997),
])
def test_shipped_model_configs_have_the_papers_shapes(name, layers, hidden, heads, billions):
    m = load_model_config(name)
    assert (m.num_layers, m.hidden_size, m.num_heads) == (layers, hidden, heads)
    assert m.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_yaml_config_with_preset_and_unknown_keys(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("model: {preset: tiny-llama, num_layers: 2}\nplanner: {chunk_size: 32}\n")
    cfg = load_config(good, pp=2)
    assert (cfg.model.family, cfg.model.num_layers, cfg.model.num_kv_heads) == ("llama", 2, 2)
    assert (cfg.planner.chunk_size, cfg.parallel.pp) == (32, 2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("planner: {chunk: 32}\n")
    with pytest.raises(ConfigError, match="unknown field.*chunk.*known: .*chunk_size"):
        load_config(bad)
    with pytest.raises(ConfigError, match="unknown section"):
        config_from_dict({"planer": {}})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_every_shipped_config_loads():
    from pp_runtime.config import CONFIG_DIR

    paths = [p for sub in ("", "paper/", "cpu/") for p in sorted(CONFIG_DIR.glob(f"{sub}*.yaml"))]
    assert paths
    for path in paths:
        load_config(path)


def test_memory_formula_reproduces_the_papers_batch_sizes():
    """B = floor((M_G - M_S) / (L * m_kv)): GPT-3 on A100-80GB gives 27 per micro-batch for
    TP8 x PP8 and 11 for TP8 alone (paper §5.3), with 90% of memory usable and L = 4096."""
    cfg = load_config("paper/gpt3_tp8_pp8")
    plan = memory_plan(cfg)
    assert plan.kv_bytes_per_token == 2 * 12 * 12 * 128 * 2  # K+V, 12 layers, 12 heads/rank, fp16
    assert plan.batch_per_microbatch == 27
    assert memory_plan(cfg.with_overrides(pp=1)).batch_per_microbatch == 11
    # by hand: M_S = 174.6e9 params * 2 B / 64 devices
    assert plan.param_bytes == pytest.approx(174.63e9 * 2 / 64, rel=1e-3)
    with pytest.raises(ConfigError, match="device_memory_gb"):
        memory_plan(Config())


def test_unknown_model_family_in_checkpoint(tmp_path):
    from pp_runtime.model.loader import model_config_from_hf

    with pytest.raises(ConfigError, match="unknown model family 'bert'"):
        model_config_from_hf({"model_type": "bert"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    from pp_runtime import LLM

    with pytest.raises(ConfigError, match="model.family"):
        LLM.from_pretrained(tmp_path)


def test_model_config_defaults_follow_the_family():
    gpt, llama = ModelConfig(family="gpt"), ModelConfig(family="llama")
    assert (gpt.act, gpt.use_bias, gpt.tied) == ("gelu_new", True, True)
    assert (llama.act, llama.use_bias, llama.tied) == ("silu", False, False)


def test_dotted_overrides_reach_sections_sharing_a_field_name():
    cfg = Config().with_overrides(**{"workload.seed": 7, "seed": 3, "hardware.gpu": "h100", "dp": 2})
    assert (cfg.workload.seed, cfg.runtime.seed, cfg.hardware.gpu, cfg.parallel.dp) == (7, 3, "h100", 2)
    with pytest.raises(ConfigError, match="unknown config field 'planner.seed'"):
        Config().with_overrides(**{"planner.seed": 1})
    with pytest.raises(ConfigError, match="workload.num_requests"):
        Config().with_overrides(num_requests=0)


# ---- parallel.layer_split ---------------------------------------------------------------
@pytest.mark.parametrize("split, pp, problem", [
    ([6, 5], 2, r"\[6, 5\] sums to 11 layers, the model has 12"),
    ([6, 6, 0], 3, "leaves a stage with no layer"),
    ([12, 0], 2, "leaves a stage with no layer"),
    ([4, 4, 4], 2, "has 3 entries for pp = 2"),
    ([6, 6], 1, "has 2 entries for pp = 1"),  # pp = 1: only [num_layers] fits
    ([], 1, "has 0 entries for pp = 1"),
    ([6.25, 5.75], 2, "holds a count that is not a whole or half layer"),
    ([True, 11], 2, "holds a count that is not a whole or half layer"),
    ("evenly", 2, "unknown value 'evenly'"),  # "even" is a value (issue 22)
    (7, 2, "got 7"),
], ids=str)
def test_a_bad_layer_split_names_the_field_and_the_fix(split, pp, problem):
    with pytest.raises(ConfigError, match=r"parallel\.layer_split: .*" + problem) as err:
        Config().with_overrides(pp=pp, layer_split=split)
    assert "summing to model.num_layers = 12" in str(err.value)  # the fix, with an example
    assert "auto" in str(err.value) and "null" in str(err.value)


def test_layer_split_from_yaml_resolves_to_stage_bounds(tmp_path):
    """A list from YAML cuts the layers as given; null (the default) is the even split,
    earlier stages taking the remainder; pp = 1 holds every layer."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: gpt2-small}\nparallel: {pp: 3, layer_split: [5, 4, 3]}\n")
    cfg = load_config(path)
    assert cfg.layers_per_stage() == [5, 4, 3]
    assert [cfg.stage_layers(s) for s in range(3)] == [(0, 5), (5, 9), (9, 12)]
    even = Config().with_overrides(num_layers=13, pp=4)
    assert even.parallel.layer_split is None
    assert [even.stage_layers(s) for s in range(4)] == [(0, 4), (4, 7), (7, 10), (10, 13)]
    assert Config().with_overrides(layer_split=[12]).stage_layers(0) == (0, 12)
    assert Config().with_overrides(layer_split="auto").layers_per_stage() == [12]  # pp = 1
    # an explicit list goes with its pp: changing pp alone is refused, not silently re-cut
    with pytest.raises(ConfigError, match="layer_split"):
        cfg.with_overrides(pp=2)


def test_a_relative_profile_beside_the_config_is_read_from_there(tmp_path, monkeypatch):
    """`hardware.profile: profiles/x` names the directory beside the config file (a shipped
    config carries its profile); a relative path that is not there stays as given, relative
    to where the command runs."""
    (tmp_path / "cfgs" / "profiles" / "x").mkdir(parents=True)
    body = "model: tiny-gpt\nhardware: {profile: %s}\n"
    (tmp_path / "cfgs" / "beside.yaml").write_text(body % "profiles/x")
    (tmp_path / "cfgs" / "elsewhere.yaml").write_text(body % "runs/prof")
    monkeypatch.chdir(tmp_path)
    beside = load_config(str(tmp_path / "cfgs" / "beside.yaml"))
    assert beside.hardware.profile == str((tmp_path / "cfgs" / "profiles" / "x").resolve())
    assert load_config(str(tmp_path / "cfgs" / "elsewhere.yaml")).hardware.profile == "runs/prof"
    # an override on the command line is taken as given
    over = load_config(str(tmp_path / "cfgs" / "beside.yaml"), **{"hardware.profile": "p"})
    assert over.hardware.profile == "p"
